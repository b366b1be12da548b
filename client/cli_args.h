// Parsing logprob-client's command line:
//   logprob-client health --server HOST:PORT [--wait SECONDS]
//   logprob-client score --server HOST:PORT --input IN --output OUT [options]
//   logprob-client bench --server HOST:PORT [shape] [options] [load options]
//   logprob-client heads --server HOST:PORT
//   logprob-client update-lm-head --server HOST:PORT --head NAME --version V --input PATH [--tensor NAME]
//   logprob-client --version
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/bench.h"
#include "client/commands.h"
#include "client/lm_head_command.h"

namespace logprob::client {

/// A parsed command line.
struct CommandLine {
  enum class Command { kHelp, kVersion, kHealth, kScore, kBench, kHeads, kUpdateLmHead };
  Command command = Command::kHelp;
  HealthArgs health;   // set for kHealth
  ScoreArgs score;     // set for kScore
  BenchArgs bench;     // set for kBench
  LmHeadArgs lm_head;  // set for kHeads and kUpdateLmHead
};

/// Parses the arguments after the program name. Flags are "--name VALUE"
/// or "--name=VALUE"; `--entropy` (and bench's `--json`, `--no-echo`)
/// take no value. A first argument "help",
/// or "--help" / "-h" anywhere, gives kHelp; "--version" as the first
/// argument gives kVersion (after a command, --version is
/// update-lm-head's flag). INVALID_ARGUMENT names the
/// problem: no or unknown command, unknown flag, missing value, a value
/// that is not a number or out of range, a missing required flag
/// (--server; --input and --output for score; --head, --version and
/// --input for update-lm-head), a --server that is not HOST:PORT or a gRPC
/// resolver URI (CheckTarget: a URL scheme, no port, ...), --tls-cert without
/// --tls-key or the reverse; for bench, --packed with --seq, --requests
/// with --duration, and shapes ValidateBenchShape refuses. Every command
/// takes the security flags
/// --tls-ca, --tls-cert, --tls-key, --tls-server-name, --auth-token-file
/// (files are read when the channel is made, not here).
absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args);

/// The usage text printed by --help and after a command-line error.
std::string UsageText();

}  // namespace logprob::client
