// The CUDA side of host-staged device collectives
// (worker/comm/host_staged_device_collectives.h): synchronised copies between
// host memory and one device's memory. Only built with CUDA.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "worker/comm/host_staged_device_collectives.h"
#include "worker/cuda/device_buffers.h"

namespace logprob::cuda {

/// DeviceCopy on device `device`: cudaMemcpyAsync on a non-blocking stream
/// of its own, then cudaStreamSynchronize, so a copy from pageable host
/// memory has landed when the call returns (a plain cudaMemcpy may return
/// earlier) and no other stream's work is waited for: the caller makes
/// sure the device input is complete first (the CUDA backend waits for its
/// streams before a device collective). INTERNAL on a CUDA error.
/// Thread-safe.
class CudaDeviceCopy final : public DeviceCopy {
 public:
  /// Makes `device` current and creates the stream. INTERNAL on failure.
  static absl::StatusOr<std::unique_ptr<CudaDeviceCopy>> Create(int device);
  absl::Status ToHost(void* host, const void* device, size_t bytes) override;
  absl::Status ToDevice(void* device, const void* host, size_t bytes) override;

 private:
  explicit CudaDeviceCopy(int device) : device_(device) {}
  /// One synchronised copy of `bytes` of kind `kind`.
  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, const char* what);

  const int device_;
  Stream stream_;
};

}  // namespace logprob::cuda
