// The lm_head backward's element-wise kernels (backward_kernels.h).
#include "common/tf32_round.h"
#include "worker/cuda/backward_kernels.h"
#include "worker/cuda/cuda_error.h"

namespace logprob::cuda {
namespace {

unsigned Blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<unsigned>(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

__global__ void LogitGradientsKernel(LogitGradArgs a) {
  const int64_t total = a.rows * a.row_stride;
  const double scale = a.scale, cap = a.softcap;
  const double inv_t = 1.0 / static_cast<double>(a.temperature);
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / a.row_stride, v = e % a.row_stride;
    float* z = a.logits + e;
    if (v >= a.len) {
      *z = 0.0f;
      continue;
    }
    const int64_t t = a.targets != nullptr ? a.targets[i] : -1;
    const bool scored = t >= 0;
    const double g_lp = scored && a.grad_logprobs != nullptr ? static_cast<double>(a.grad_logprobs[i]) : 0.0;
    const double g_ent = a.grad_entropy != nullptr ? static_cast<double>(a.grad_entropy[i]) : 0.0;
    const double lse = a.lse[i];
    const double ent = g_ent != 0.0 ? static_cast<double>(a.entropy[i]) : 0.0;
    // x as the forward computed it: z / T in float32.
    const float xf = a.temperature != 1.0f ? __fdiv_rn(*z, a.temperature) : *z;
    const double x = xf, p = exp(x - lse);
    double gx = -g_lp * p - g_ent * p * (x - lse + ent);
    if (scored && v == t - a.vocab_begin) gx += g_lp;
    double gy = gx * inv_t * scale;
    if (cap != 0.0) {
      const double r = static_cast<double>(*z) / cap;
      gy *= 1.0 - r * r;
    }
    *z = static_cast<float>(gy);
  }
}

__global__ void ColumnSumsKernel(const float* dy, int64_t rows, int64_t len, int64_t row_stride, float* grad_bias) {
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < len; c += int64_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (int64_t r = 0; r < rows; ++r) s += dy[r * row_stride + c];
    grad_bias[c] += s;
  }
}

__global__ void RoundToTf32Kernel(const float* src, int64_t n, float* dst) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = RoundToTf32(src[i]);
}

}  // namespace

cudaError_t LaunchRoundToTf32(const float* src, int64_t n, float* dst, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchCheck<> check;
  RoundToTf32Kernel<<<Blocks(n), 256, 0, stream>>>(src, n, dst);
  return check.Result();
}

cudaError_t LaunchLogitGradients(const LogitGradArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.row_stride <= 0) return cudaSuccess;
  const LaunchCheck<> check;
  LogitGradientsKernel<<<Blocks(args.rows * args.row_stride), 256, 0, stream>>>(args);
  return check.Result();
}

cudaError_t LaunchColumnSums(const float* dy, int64_t rows, int64_t len, int64_t row_stride, float* grad_bias,
                             cudaStream_t stream) {
  if (rows <= 0 || len <= 0) return cudaSuccess;
  const LaunchCheck<> check;
  ColumnSumsKernel<<<Blocks(len), 256, 0, stream>>>(dy, rows, len, row_stride, grad_bias);
  return check.Result();
}

}  // namespace logprob::cuda
