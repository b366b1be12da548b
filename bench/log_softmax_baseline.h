// Baseline kernel of logprob_cuda_bench (bench/log_softmax_baseline.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace logprob::cuda {

/// In place: logits[T, V] (device, f32, row-major) becomes log_softmax of
/// each row (three passes: max, sum of exp, subtract), and logprobs[t] =
/// the result at targets[t] (device, ids in [0, V)). Asynchronous.
cudaError_t LaunchLogSoftmaxGather(float* logits, int64_t T, int64_t V, const int64_t* targets, float* logprobs,
                                   cudaStream_t stream);

}  // namespace logprob::cuda
