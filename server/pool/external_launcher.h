// Cluster mode: the pool's workers are started elsewhere (one per GPU,
// e.g. a Kubernetes StatefulSet) and join the control plane themselves.
#pragma once

#include <string>

#include "server/pool/worker_launcher.h"

namespace logprob {

/// Launches nothing and owns no process: `workers` logprob-worker
/// processes started with `--frontend` pointing at the control plane join
/// by themselves and, after their generation ends, join again (their
/// `--rejoin` default). A worker's failure is seen through its Join stream
/// and its Worker calls, not through a process handle.
class ExternalLauncher final : public WorkerLauncher {
 public:
  explicit ExternalLauncher(int workers) : workers_(workers) {}

  absl::Status Launch(int64_t generation, const std::string& frontend) override;
  std::optional<std::string> Poll() override { return std::nullopt; }
  void Stop() override {}
  bool waits_for_workers() const override { return true; }
  bool same_host() const override { return false; }  // not known: payloads go through gRPC
  std::string Describe() const override;

 private:
  const int workers_;
};

}  // namespace logprob
