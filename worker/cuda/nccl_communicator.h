// Communicator over NCCL (one GPU per rank), bootstrapped through the
// front-end's key-value store: rank 0's ncclUniqueId is published there,
// as the Gloo rendezvous publishes its addresses.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <memory>

#include "absl/status/statusor.h"
#include "gloo/rendezvous/store.h"
#include "worker/comm/communicator.h"
#include "worker/cuda/device_buffers.h"

namespace logprob::cuda {

/// NCCL group of `size()` ranks. The host collectives stage their buffers
/// through device buffers (upload, NCCL on `stream`, download); the
/// *Device ones run on device buffers directly. Each waits for completion, polling the
/// communicator's async error. A failed or timed-out collective aborts the
/// communicator (ncclCommAbort) and returns UNAVAILABLE or
/// DEADLINE_EXCEEDED; the group is unusable afterwards (the front-end
/// starts a new generation of workers).
class NcclCommunicator final : public Communicator {
 public:
  /// Rank 0 creates the unique id and sets key "nccl_unique_id" in `store`;
  /// the others wait for it (up to `timeout`). `device` must be current
  /// and distinct per rank (NCCL needs one GPU per rank). `stream`: the
  /// stream to run collectives on (null: a new one).
  /// The communicator is non-blocking (ncclConfig_t blocking = 0): it
  /// must be ready within `timeout` (polling ncclCommGetAsyncError), else
  /// it is aborted (ncclCommAbort) and Create returns DEADLINE_EXCEEDED, so
  /// a peer that never joins does not hang the worker.
  /// UNAVAILABLE when the store or ncclCommInitRankConfig fails.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(gloo::rendezvous::Store& store, int rank, int size,
                                                                  int device, cudaStream_t stream,
                                                                  std::chrono::milliseconds timeout);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllGather(const void* in, size_t bytes, void* out) override;
  absl::Status AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                         const std::vector<int64_t>& recv_bytes) override;
  /// Device buffers of this rank's GPU, on `stream`; the caller makes sure
  /// its inputs are complete first (the CUDA backend waits for its uploads
  /// and kernels). Waits as the host collectives do (timeout, abort),
  /// without staging. In-place all-gather (in == out + AllGatherOffset(
  /// rank, bytes)) is allowed.
  bool device_collectives() const override { return true; }
  absl::Status AllGatherDevice(const void* in, size_t bytes, void* out) override;
  absl::Status AllToAllVDevice(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                               const std::vector<int64_t>& recv_bytes) override;

 private:
  /// Enqueues the grouped sends and receives of an all-to-all between
  /// device buffers `in` and `out`.
  ncclResult_t EnqueueAllToAllV(const char* in, const std::vector<int64_t>& send_bytes, char* out,
                                const std::vector<int64_t>& recv_bytes);
  /// Fails if the group is broken; makes the device current.
  absl::Status Usable();
  NcclCommunicator() = default;
  /// Uploads `bytes` of `in`, or fails if the group is already broken.
  absl::Status Begin(const void* in, size_t in_bytes, size_t out_bytes);
  /// Downloads `bytes` into `out` and waits (with the timeout) for the
  /// collective and the copy; aborts the communicator on failure.
  absl::Status Finish(const char* what, ncclResult_t enqueued, void* out, size_t out_bytes);
  absl::Status Abort(absl::Status why);
  /// Polls the communicator's asynchronous error until it is not
  /// ncclInProgress (ncclSuccess: ready) or `deadline` passes
  /// (ncclInProgress returned).
  ncclResult_t WaitReady(std::chrono::steady_clock::time_point deadline);

  int rank_ = 0, size_ = 1, device_ = 0;
  std::chrono::milliseconds timeout_{60000};
  ncclComm_t comm_ = nullptr;
  bool broken_ = false;
  Stream own_stream_;
  cudaStream_t stream_ = nullptr;
  Event done_;
  DeviceBuffer in_dev_, out_dev_;
  // Pinned staging of the download: a cudaMemcpyAsync into pageable host
  // memory blocks until the collective finishes, which would bypass the
  // timeout / abort in Finish when a peer is gone.
  PinnedBuffer out_host_;
};

}  // namespace logprob::cuda
