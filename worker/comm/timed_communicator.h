// A Communicator decorator that measures the time spent in collectives
// (WorkResult.collective_seconds, metric logprob_collective_duration_seconds).
#pragma once

#include "worker/comm/communicator.h"

namespace logprob {

/// Forwards every collective to `inner` and adds its wall time to seconds().
/// Not thread-safe (one work item at a time, as the communicator itself).
class TimedCommunicator final : public Communicator {
 public:
  explicit TimedCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  absl::Status AllGather(const void* in, size_t bytes, void* out) override;
  absl::Status AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                         const std::vector<int64_t>& recv_bytes) override;
  bool device_collectives() const override { return inner_.device_collectives(); }
  absl::Status AllGatherDevice(const void* in, size_t bytes, void* out) override;
  absl::Status AllToAllVDevice(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                               const std::vector<int64_t>& recv_bytes) override;
  /// Seconds spent in collectives so far.
  double seconds() const { return seconds_; }

 private:
  Communicator& inner_;
  double seconds_ = 0;
};

}  // namespace logprob
