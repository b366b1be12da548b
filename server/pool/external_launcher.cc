#include "server/pool/external_launcher.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/log_line.h"

namespace logprob {

absl::Status ExternalLauncher::Launch(int64_t generation, const std::string& frontend) {
  LogLine() << "logprob-server: generation " << generation << ": waiting for " << workers_
            << " external worker(s) to join the control plane at " << frontend;
  return absl::OkStatus();
}

std::string ExternalLauncher::Describe() const { return absl::StrCat("waits for ", workers_, " external worker(s)"); }

}  // namespace logprob
