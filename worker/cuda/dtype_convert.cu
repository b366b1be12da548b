// Element type conversion on the GPU (hidden states to the lm_head GEMM's
// compute dtype), with the CPU path's rounding (common/dtype.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "worker/cuda/cuda_error.h"
#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {
namespace {

__device__ __forceinline__ float Load(const void* src, ElemType t, int64_t i) {
  switch (t) {
    case ElemType::kF32:
      return static_cast<const float*>(src)[i];
    case ElemType::kBF16:
      return __uint_as_float(uint32_t{static_cast<const uint16_t*>(src)[i]} << 16);
    default:
      return __half2float(__ushort_as_half(static_cast<const unsigned short*>(src)[i]));
  }
}

__global__ void ConvertKernel(const void* src, ElemType src_type, int64_t n, void* dst, ElemType dst_type) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float f = Load(src, src_type, i);
    if (dst_type == ElemType::kF32) static_cast<float*>(dst)[i] = f;
    else static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(f);
  }
}

}  // namespace

cudaError_t LaunchConvert(const void* src, ElemType src_type, int64_t n, void* dst, ElemType dst_type,
                          cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dst_type == ElemType::kF16) return cudaErrorInvalidValue;
  const int64_t blocks = (n + 255) / 256;
  const LaunchCheck<> check;  // reports this launch's error, not a stale one
  ConvertKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(src, src_type, n, dst,
                                                                                            dst_type);
  return check.Result();
}

}  // namespace logprob::cuda
