// Packed partial records of rows of logits on the GPU (the CUDA twin of
// kernels::ComputePartial): one block per row, one pass with online
// softmax for m, s, u (and the coarse key histogram of the top-k), then
// the top-k (topk_select.cuh).
#include <cmath>

#include "worker/cuda/cuda_error.h"
#include "worker/cuda/row_common.cuh"
#include "worker/cuda/topk_select.cuh"

namespace logprob::cuda {
namespace {

__device__ __forceinline__ float NanBits() { return __uint_as_float(record::kAbsentXBits); }  // = nanf("")

/// x of global id `id` on this slice, NaN outside it (as the CPU kernel).
__device__ __forceinline__ float XAt(const RowView& r, int64_t vocab_begin, int64_t id) {
  if (id < vocab_begin || id >= vocab_begin + r.len) return NanBits();
  return r.X(id - vocab_begin);
}

__device__ __forceinline__ void PutDouble(uint32_t* at, double d) {
  const unsigned long long b = static_cast<unsigned long long>(__double_as_longlong(d));
  at[0] = static_cast<uint32_t>(b);
  at[1] = static_cast<uint32_t>(b >> 32);
}

/// kExtras: any of log_sum_sq_probs, mean_logits, is_top1 asked (without
/// them the pass is the plain one, instruction for instruction).
template <bool kTopk, bool kExtras>
__global__ void __launch_bounds__(kRowThreads) RowPartialsKernel(RowBlockArgs a) {
  const int64_t row = blockIdx.x;
  __shared__ unsigned hist[kTopkBins];
  const RowView r{static_cast<const char*>(a.logits) + row * a.row_stride * ElemSize(a.type), a.type, a.len,
                  a.temperature, a.keep_min ? a.keep_min[row] : -INFINITY};
  if (kTopk) {
    for (int b = threadIdx.x; b < kTopkBins; b += blockDim.x) hist[b] = 0;
    __syncthreads();
  }
  // is_top1: columns before the target's (local index; 0 = none).
  const int64_t t_local = kExtras && a.is_top1 && a.targets[row] >= 0 ? a.targets[row] - a.vocab_begin : 0;
  // Per-thread online softmax: s = sum e^(x - m), u = sum e^(x - m) (x - m),
  // q = sum e^(2(x - m)); zsum = sum of x before the filter; ptm = max x
  // of the columns before the target.
  float m = -INFINITY, s = 0.f, u = 0.f, q = 0.f, zsum = 0.f, ptm = -INFINITY;
  ForEachX<false>(r, [&](float scaled, int64_t i) {
    if (kExtras && a.mean_logits) zsum += scaled;
    const float x = r.Filter(scaled);
    if (kTopk) atomicAdd(&hist[Key(x) >> (32 - kTopkBinBits)], 1u);
    if (kExtras && i < t_local) ptm = fmaxf(ptm, x);
    if (x > m) {
      if (m > -INFINITY) {
        const float d = m - x, c = __expf(d);
        u = c * (u + s * d);
        s *= c;
        if (kExtras) q *= c * c;
      }
      m = x;
    }
    if (x > -INFINITY) {
      const float d = x - m, e = __expf(d);
      s += e;
      u += e * d;
      if (kExtras) q += e * e;
    }
  });
  const float M = BlockMax(m);
  const double w = m > -INFINITY ? exp(static_cast<double>(m) - M) : 0.0;
  const double S = BlockSum(static_cast<double>(s) * w);
  const double U = BlockSum(m > -INFINITY ? (static_cast<double>(u) + s * (static_cast<double>(m) - M)) * w : 0.0);
  // The requested extras (a.* are the same for the whole block, so every
  // thread takes the same branches to the barriers inside).
  const double Q = kExtras && a.log_sum_sq_probs ? BlockSum(static_cast<double>(q) * w * w) : 0.0;
  const double Z = kExtras && a.mean_logits ? BlockSum(static_cast<double>(zsum)) : 0.0;
  const float PTM = kExtras && a.is_top1 ? BlockMax(ptm) : -INFINITY;

  uint32_t* rec = a.records + row * record::Words(a.gather_k, a.topk);
  if (threadIdx.x == 0) {
    rec[record::kMaxWord] = __float_as_uint(M);
    rec[record::kTargetWord] =
        a.targets[row] >= 0 ? __float_as_uint(XAt(r, a.vocab_begin, a.targets[row])) : record::kAbsentXBits;
    PutDouble(rec + record::kSWord, S);
    PutDouble(rec + record::kUWord, U);
    PutDouble(rec + record::kQWord, Q);
    PutDouble(rec + record::kZSumWord, Z);
    rec[record::kPreTargetMaxWord] = __float_as_uint(PTM);
    rec[record::kReservedWord] = 0;
  }
  for (int j = threadIdx.x; j < a.gather_k; j += blockDim.x)
    rec[record::GatherWord(j)] = __float_as_uint(XAt(r, a.vocab_begin, a.gather_ids[row * a.gather_k + j]));
  if (kTopk) {
    float* tv = reinterpret_cast<float*>(rec + record::TopkValueWord(a.gather_k, 0));
    int32_t* ti = reinterpret_cast<int32_t*>(rec + record::TopkIdWord(a.gather_k, a.topk, 0));
    BlockTopK(r, a.vocab_begin, a.topk, hist, a.topk_scratch_x + row * a.topk, a.topk_scratch_id + row * a.topk, tv,
              ti);
  }
}

}  // namespace

cudaError_t LaunchRowPartials(const RowBlockArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return cudaSuccess;
  const LaunchCheck<> check;  // reports this launch's error, not a stale one
  const unsigned blocks = static_cast<unsigned>(a.rows);
  const bool extras = a.log_sum_sq_probs || a.mean_logits || a.is_top1;
  if (a.topk > 0 && extras) RowPartialsKernel<true, true><<<blocks, kRowThreads, 0, stream>>>(a);
  else if (a.topk > 0) RowPartialsKernel<true, false><<<blocks, kRowThreads, 0, stream>>>(a);
  else if (extras) RowPartialsKernel<false, true><<<blocks, kRowThreads, 0, stream>>>(a);
  else RowPartialsKernel<false, false><<<blocks, kRowThreads, 0, stream>>>(a);
  return check.Result();
}

namespace {
__global__ void TrapKernel() { __trap(); }
}  // namespace

cudaError_t LaunchTrap(cudaStream_t stream) {
  const LaunchCheck<> check;
  TrapKernel<<<1, 1, 0, stream>>>();
  return check.Result();
}

}  // namespace logprob::cuda
