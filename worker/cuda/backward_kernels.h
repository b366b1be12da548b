// Launchers of the lm_head backward's element-wise CUDA kernels
// (backward_kernels.cu): the device twin of kernels::LogitGradients
// (worker/kernels/head_backward.h, the math) and the bias gradient's
// column sums. Plain types only: included by nvcc and g++ alike.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace logprob::cuda {

/// In place over rows x row_stride f32 (device): the transformed logits z
/// of columns [0, len) (global ids vocab_begin + c) become dL/dy, computed
/// in float64 per element and rounded once, as kernels::LogitGradients
/// does; columns [len, row_stride) become 0 (the GEMMs' zero padding).
struct LogitGradArgs {
  float* logits = nullptr;
  int64_t rows = 0, len = 0, row_stride = 0, vocab_begin = 0;
  const int64_t* targets = nullptr;      // device [rows], global ids; < 0: no logprob term
  const float* lse = nullptr;            // device [rows]: the whole vocabulary's logsumexp of z / T
  const float* entropy = nullptr;        // device [rows] or null (with grad_entropy null)
  const float* grad_logprobs = nullptr;  // device [rows] or null: 0
  const float* grad_entropy = nullptr;   // device [rows] or null: 0
  float temperature = 1.0f, scale = 1.0f, softcap = 0.0f;
};
/// Asynchronous on `stream`; its own launch error only (LaunchCheck).
cudaError_t LaunchLogitGradients(const LogitGradArgs& args, cudaStream_t stream);

/// grad_bias[c] += the sum over rows r in order of dy[r * row_stride + c],
/// for c < len (one thread per column: the same sequence whatever the
/// launch). Asynchronous on `stream`; its own launch error only.
cudaError_t LaunchColumnSums(const float* dy, int64_t rows, int64_t len, int64_t row_stride, float* grad_bias,
                             cudaStream_t stream);

/// dst[i] = RoundToTf32(src[i]) (common/tf32_round.h: the CPU's tf32
/// operands), i < n; dst may be src. Asynchronous on `stream`; its own
/// launch error only.
cudaError_t LaunchRoundToTf32(const float* src, int64_t n, float* dst, cudaStream_t stream);

}  // namespace logprob::cuda
