// logprob-client: command-line client of the logprob scoring service.
// See UsageText() in client/cli_args.cc and docs/SPEC.md.
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli_args.h"
#include "client/commands.h"
#include "common/malloc_tuning.h"
#include "common/version.h"

int main(int argc, char** argv) {
  using logprob::client::CommandLine;
  // Large messages reuse freed pages instead of faulting in fresh ones
  // (LOGPROB_KEEP_FREED_MEMORY_BYTES=0: glibc's defaults).
  const char* keep = std::getenv("LOGPROB_KEEP_FREED_MEMORY_BYTES");
  logprob::KeepFreedMemory(keep != nullptr ? std::atoll(keep) : int64_t{4} << 30);
  const std::vector<std::string> args(argv + 1, argv + argc);
  absl::StatusOr<CommandLine> cl = logprob::client::ParseCommandLine(args);
  if (!cl.ok()) {
    // The error alone: the usage is ~150 lines, which would bury it.
    std::cerr << "error: " << cl.status().message() << "\n(logprob-client --help shows the usage)\n";
    return logprob::client::kExitBadInput;
  }
  switch (cl->command) {
    case CommandLine::Command::kHelp:
      std::cout << logprob::client::UsageText();
      return logprob::client::kExitOk;
    case CommandLine::Command::kVersion:
      std::cout << logprob::VersionText("logprob-client");
      return logprob::client::kExitOk;
    case CommandLine::Command::kHealth:
      return logprob::client::RunHealth(cl->health);
    case CommandLine::Command::kScore:
      return logprob::client::RunScore(cl->score);
    case CommandLine::Command::kBench:
      return logprob::client::RunBench(cl->bench);
    case CommandLine::Command::kHeads:
      return logprob::client::RunHeads(cl->lm_head);
    case CommandLine::Command::kUpdateLmHead:
      return logprob::client::RunUpdateLmHead(cl->lm_head);
  }
  return logprob::client::kExitBadInput;
}
