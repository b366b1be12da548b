// The head's logit transform on the GPU (worker/cuda/lm_head_transform.h):
// one thread per element, the same inline TransformLogit as the CPU path.
#include "common/lm_head_logit.h"
#include "worker/cuda/cuda_error.h"
#include "worker/cuda/lm_head_transform.h"

namespace logprob::cuda {
namespace {

__global__ void LmHeadTransformKernel(float* logits, int64_t M, int64_t N, const float* bias, float scale,
                                      float softcap) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const float b = bias != nullptr ? bias[i % N] : 0.0f;
    logits[i] = TransformLogit(logits[i], b, scale, softcap);
  }
}

}  // namespace

cudaError_t LaunchLmHeadTransform(float* logits, int64_t M, int64_t N, const float* bias, float scale, float softcap,
                                  cudaStream_t stream) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  const int64_t blocks = (M * N + 255) / 256;
  // Its own launch error only: a stale error another call left on this
  // thread is not this GEMM's failure (issue 50).
  const LaunchCheck<> check;
  LmHeadTransformKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), 256, 0, stream>>>(logits, M, N, bias,
                                                                                                    scale, softcap);
  return check.Result();
}

}  // namespace logprob::cuda
