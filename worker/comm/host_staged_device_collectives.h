// Device-memory collectives for a communicator that only moves host memory
// (Gloo), staged through host buffers: copy the device input to the host,
// run the host collective, copy the result back to the device. With it the
// CUDA backend scores hidden states in one pass over Gloo as over NCCL
// (ScoringBackend::OnePassHidden), so two workers sharing one GPU (which
// NCCL refuses) run the W >= 2 one-pass logic. The staging is here and
// nowhere else; the device copies come from a DeviceCopy (CUDA:
// worker/cuda/cuda_device_copy.h; tests: a host memcpy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "worker/comm/communicator.h"

namespace logprob {

/// Copies between host memory and the device memory of one device. Each
/// call returns once the bytes have landed (synchronised), so the host may
/// read or reuse its buffer and later device work sees the data. Errors:
/// INTERNAL (a device error). Implementations must be thread-safe.
class DeviceCopy {
 public:
  virtual ~DeviceCopy() = default;
  /// `bytes` bytes from device memory `device` to host memory `host`.
  virtual absl::Status ToHost(void* host, const void* device, size_t bytes) = 0;
  /// `bytes` bytes from host memory `host` to device memory `device`.
  virtual absl::Status ToDevice(void* device, const void* host, size_t bytes) = 0;
};

/// A Communicator whose *Device collectives are `inner`'s host collectives
/// on host copies of the device buffers (device_collectives() is true); the
/// host collectives are forwarded unchanged. The caller makes sure the
/// device inputs are complete before a call, as for NCCL; each call returns
/// once the device output holds the result. In-place all-gathers (in ==
/// out + AllGatherOffset(rank, bytes)) are allowed: the input is copied out
/// first.
///
/// Before the host collective every rank agrees (one 1-byte host
/// all-gather, FirstRankFlagged) that all of them staged their input: a
/// rank whose host buffer could not be allocated, whose device copy failed
/// or whose sizes are wrong never leaves its peers waiting in the
/// collective. Then that rank returns its own error and the others
/// RESOURCE_EXHAUSTED naming it. After the copy back to the device they
/// agree again, so a rank whose copy failed does not leave its peers going
/// on alone (its error there; INTERNAL naming it on the others). Either
/// way every rank returns an error and the group stays usable. Errors of the
/// host collectives are `inner`'s (UNAVAILABLE / DEADLINE_EXCEEDED: the
/// group is unusable afterwards). Host buffers grow to the largest
/// collective and are kept. Not thread-safe: one collective at a time, as
/// any Communicator.
class HostStagedDeviceCollectives final : public Communicator {
 public:
  HostStagedDeviceCollectives(std::unique_ptr<Communicator> inner, std::unique_ptr<DeviceCopy> copy)
      : inner_(std::move(inner)), copy_(std::move(copy)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllGather(const void* in, size_t bytes, void* out) override { return inner_->AllGather(in, bytes, out); }
  absl::Status AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                         const std::vector<int64_t>& recv_bytes) override {
    return inner_->AllToAllV(in, send_bytes, out, recv_bytes);
  }
  bool device_collectives() const override { return true; }
  /// `in`: `bytes` of device memory; `out`: size() * bytes of device
  /// memory. Nothing is moved (and no collective runs) when bytes == 0,
  /// which every rank passes alike.
  absl::Status AllGatherDevice(const void* in, size_t bytes, void* out) override;
  /// `in`: sum(send_bytes) bytes of device memory, `out`: sum(recv_bytes);
  /// both vectors have size() non-negative entries (INVALID_ARGUMENT on
  /// this rank otherwise, after the agreement). Zero counts are fine.
  absl::Status AllToAllVDevice(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                               const std::vector<int64_t>& recv_bytes) override;

 private:
  /// Grows `buffer` to at least max(bytes, 1) bytes and copies `bytes` of
  /// device memory `device` into it. RESOURCE_EXHAUSTED when the host
  /// memory cannot be had; the copy's error.
  absl::Status StageIn(const void* device, size_t bytes, std::vector<char>& buffer);
  /// Grows `buffer` to at least max(bytes, 1) bytes (RESOURCE_EXHAUSTED).
  static absl::Status Reserve(std::vector<char>& buffer, size_t bytes);
  /// The two sides of a host collective.
  enum class Step { kStageIn, kStageOut };
  /// All ranks learn whether every rank succeeded at `step` (`mine` is this
  /// rank's result): OK when all did; else `mine` on a rank that failed
  /// and, naming the lowest failed rank, RESOURCE_EXHAUSTED (kStageIn) or
  /// INTERNAL (kStageOut) on the others; the agreement's error when it
  /// fails.
  absl::Status Agree(const absl::Status& mine, Step step);

  std::unique_ptr<Communicator> inner_;
  std::unique_ptr<DeviceCopy> copy_;
  std::vector<char> in_host_, out_host_;
};

}  // namespace logprob
