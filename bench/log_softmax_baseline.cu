// The baseline of logprob_cuda_bench's hidden mode: an in-place float32
// log_softmax of every row of materialised logits [T, V] and the gather of
// each row's target (what a trainer does after the full lm_head GEMM).
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/log_softmax_baseline.h"
#include "worker/cuda/cuda_error.h"

namespace logprob::cuda {
namespace {

constexpr int kThreads = 256;

__device__ float BlockReduce(float v, bool is_max) {
  __shared__ float part[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float r = part[0];
  for (int i = 1; i < kThreads / 32; ++i) r = is_max ? fmaxf(r, part[i]) : r + part[i];
  __syncthreads();
  return r;
}

__global__ void LogSoftmaxGather(float* logits, int64_t V, const int64_t* targets, float* logprobs) {
  float* row = logits + blockIdx.x * V;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) m = fmaxf(m, row[i]);
  m = BlockReduce(m, true);
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) s += expf(row[i] - m);
  const float lse = m + logf(BlockReduce(s, false));
  for (int64_t i = threadIdx.x; i < V; i += kThreads) row[i] -= lse;
  __syncthreads();
  if (threadIdx.x == 0) logprobs[blockIdx.x] = row[targets[blockIdx.x]];
}

}  // namespace

cudaError_t LaunchLogSoftmaxGather(float* logits, int64_t T, int64_t V, const int64_t* targets, float* logprobs,
                                   cudaStream_t stream) {
  if (T <= 0) return cudaSuccess;
  const logprob::cuda::LaunchCheck<> check;  // this launch's error, not a stale one
  LogSoftmaxGather<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(logits, V, targets, logprobs);
  return check.Result();
}

}  // namespace logprob::cuda
