#include "worker/cuda/cuda_device_copy.h"

namespace logprob::cuda {

absl::StatusOr<std::unique_ptr<CudaDeviceCopy>> CudaDeviceCopy::Create(int device) {
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  std::unique_ptr<CudaDeviceCopy> c(new CudaDeviceCopy(device));
  LOGPROB_RETURN_IF_ERROR(c->stream_.Create());
  return c;
}

absl::Status CudaDeviceCopy::Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, const char* what) {
  if (bytes == 0) return absl::OkStatus();
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream_.get()), what);
  return CudaStatus(cudaStreamSynchronize(stream_.get()), what);
}

absl::Status CudaDeviceCopy::ToHost(void* host, const void* device, size_t bytes) {
  return Copy(host, device, bytes, cudaMemcpyDeviceToHost, "collective staging download");
}

absl::Status CudaDeviceCopy::ToDevice(void* device, const void* host, size_t bytes) {
  return Copy(device, host, bytes, cudaMemcpyHostToDevice, "collective staging upload");
}

}  // namespace logprob::cuda
