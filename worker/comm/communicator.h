// The collectives vocab-parallel scoring needs, independent of the
// transport (Gloo on CPU workers; NCCL on GPUs in the CUDA backend).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace logprob {

/// A fixed group of `size()` ranks. Every rank must call the same
/// collectives in the same order. Errors (peer gone, timeout) come back as
/// UNAVAILABLE / DEADLINE_EXCEEDED; the group is unusable afterwards.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  /// All-gather: each rank contributes `bytes` bytes at `in`; `out` receives
  /// size() * bytes, rank r's contribution at offset r * bytes.
  virtual absl::Status AllGather(const void* in, size_t bytes, void* out) = 0;

  /// All-to-all with per-peer sizes: rank r sends send_bytes[q] bytes
  /// (consecutive in `in`, in rank order) to q and receives recv_bytes[q]
  /// bytes from q into `out` (consecutive, in rank order).
  virtual absl::Status AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                 const std::vector<int64_t>& recv_bytes) = 0;

  /// True when AllGatherDevice / AllToAllVDevice take buffers in the device
  /// memory of the worker's GPU (NCCL; Gloo for CUDA workers, staged
  /// through host memory by HostStagedDeviceCollectives). The caller makes
  /// sure the input buffers are complete before the call (the CUDA backend
  /// waits for its streams' work first). Host transports alone: false.
  virtual bool device_collectives() const { return false; }
  /// AllGather on device buffers; returns once the collective finished
  /// (or failed / timed out: UNAVAILABLE / DEADLINE_EXCEEDED).
  /// UNIMPLEMENTED when device_collectives() is false.
  virtual absl::Status AllGatherDevice(const void* in, size_t bytes, void* out);
  /// AllToAllV on device buffers, as AllGatherDevice.
  virtual absl::Status AllToAllVDevice(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                       const std::vector<int64_t>& recv_bytes);
};

/// One 1-byte all-gather of every rank's `flag`: the lowest rank whose flag
/// is set, or -1 when none is (so all ranks decide alike, e.g. to stop).
/// The collective's error when it fails.
absl::StatusOr<int> FirstRankFlagged(Communicator& comm, bool flag);

/// A group of one (token-parallel work, tests): collectives are copies.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllGather(const void* in, size_t bytes, void* out) override;
  absl::Status AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                         const std::vector<int64_t>& recv_bytes) override;
};

}  // namespace logprob
