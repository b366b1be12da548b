// Spawns a pool generation's logprob-worker processes on this host.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "server/pool/worker_launcher.h"

namespace logprob {

/// Spawns `workers` processes of `binary --frontend HOST:PORT --rejoin=false
/// --exit-with-parent ARGS...` per generation, reaps them (Poll) and kills
/// them (Stop). The workers do not rejoin by themselves: the pool kills and
/// respawns them; they die with the front-end. With `secret_fd` >= 0 (a
/// PoolSecret::ToInheritableFd, owned and closed by the launcher) each
/// worker inherits it as descriptor kSecretFd and is told
/// `--internal-secret-fd=3`: the secret is in neither argv nor environ.
class LocalLauncher final : public WorkerLauncher {
 public:
  /// The descriptor number the workers read the pool secret from.
  static constexpr int kSecretFd = 3;

  LocalLauncher(int workers, std::string binary, std::vector<std::string> args, int secret_fd = -1);
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
  int secret_fd_ = -1;       // above kSecretFd, close-on-exec; -1: none
  std::vector<pid_t> pids_;  // -1 once reaped
};

}  // namespace logprob
