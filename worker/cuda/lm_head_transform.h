// The head's logit transform on the GPU: the device twin of
// ApplyLmHeadTransform (common/lm_head_transform.h), run on the cuBLASLt
// GEMM's f32 output before any statistics kernel reads it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace logprob::cuda {

/// logits[M, N] (device f32, row-major, in place) = TransformLogit(x,
/// bias[n], scale, softcap) of each element (common/lm_head_transform.h:
/// softcap(scale * (x + b)), softcap 0 = none), `bias` [N] device f32 or
/// null (no bias). Element-wise, so a row's values do not depend on M.
/// Asynchronous on `stream`; nothing is launched when M or N is 0.
/// Returns the launch's own error (LaunchCheck: an error an earlier call
/// left on this thread is cleared first, not reported; a sticky one is).
/// Not shared between threads for one stream.
cudaError_t LaunchLmHeadTransform(float* logits, int64_t M, int64_t N, const float* bias, float scale, float softcap,
                                  cudaStream_t stream);

}  // namespace logprob::cuda
