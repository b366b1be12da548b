// Spawns a pool generation's logprob-worker processes on this host.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "server/worker_launcher.h"

namespace logprob {

/// Spawns `workers` processes of `binary --frontend HOST:PORT --rejoin=false
/// --exit-with-parent ARGS...` per generation, reaps them (Poll) and kills
/// them (Stop). The workers do not rejoin by themselves: the pool kills and
/// respawns them; they die with the front-end.
class LocalLauncher final : public WorkerLauncher {
 public:
  LocalLauncher(int workers, std::string binary, std::vector<std::string> args);
  ~LocalLauncher() override;  // kills the workers

  absl::Status Launch(int64_t generation, const std::string& frontend) override;
  std::optional<std::string> Poll() override;
  void Stop() override;
  bool waits_for_workers() const override { return false; }
  bool same_host() const override { return true; }
  std::string Describe() const override;

 private:
  const int workers_;
  const std::string binary_;
  const std::vector<std::string> args_;
  std::vector<pid_t> pids_;  // -1 once reaped
};

}  // namespace logprob
