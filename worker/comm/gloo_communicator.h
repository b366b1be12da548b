// Communicator over Gloo's TCP transport (CPU workers; CUDA workers wrap it
// in HostStagedDeviceCollectives for device collectives).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gloo/context.h"
#include "gloo/rendezvous/store.h"
#include "worker/comm/communicator.h"

namespace logprob {

/// Gloo full-mesh group. Collective failures (peer died, timeout) return
/// UNAVAILABLE with Gloo's message.
class GlooCommunicator final : public Communicator {
 public:
  /// Connects rank `rank` of `size` through `store`, listening for peers on
  /// `hostname` (an address the other workers can reach).
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(gloo::rendezvous::Store& store,
                                                                  const std::string& hostname, int rank, int size,
                                                                  std::chrono::milliseconds timeout);

  int rank() const override;
  int size() const override;
  absl::Status AllGather(const void* in, size_t bytes, void* out) override;
  absl::Status AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                         const std::vector<int64_t>& recv_bytes) override;

 private:
  explicit GlooCommunicator(std::shared_ptr<gloo::Context> ctx) : ctx_(std::move(ctx)) {}
  std::shared_ptr<gloo::Context> ctx_;
  uint32_t next_tag_ = 1;
};

}  // namespace logprob
