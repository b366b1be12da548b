// Parsing logprob-client's command line:
//   logprob-client health --server HOST:PORT [--wait SECONDS]
//   logprob-client score --server HOST:PORT --input IN --output OUT [options]
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/commands.h"

namespace logprob::client {

/// A parsed command line.
struct CommandLine {
  enum class Command { kHelp, kHealth, kScore };
  Command command = Command::kHelp;
  HealthArgs health;  // set for kHealth
  ScoreArgs score;    // set for kScore
};

/// Parses the arguments after the program name. Flags are "--name VALUE"
/// or "--name=VALUE"; `--entropy` takes no value. A first argument "help",
/// or "--help" / "-h" anywhere, gives kHelp. INVALID_ARGUMENT names the
/// problem: no or unknown command, unknown flag, missing value, a value
/// that is not a number or out of range, a missing required flag
/// (--server; --input and --output for score), --tls-cert without
/// --tls-key or the reverse. Both commands take the security flags
/// --tls-ca, --tls-cert, --tls-key, --tls-server-name, --auth-token-file
/// (files are read when the channel is made, not here).
absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args);

/// The usage text printed by --help and after a command-line error.
std::string UsageText();

}  // namespace logprob::client
