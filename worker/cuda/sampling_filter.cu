// Sampling filters on full rows on the GPU: the smallest kept x per row
// (the CUDA twin of kernels::SamplingKeepMin, docs/SPEC.md "Filters").
#include <cmath>

#include "worker/cuda/cuda_error.h"
#include "worker/cuda/row_common.cuh"

namespace logprob::cuda {
namespace {

__global__ void __launch_bounds__(kRowThreads) KeepMinKernel(FilterArgs a) {
  const int64_t row = blockIdx.x;
  __shared__ unsigned hist[kRadixBins];
  __shared__ double mass[kRadixBins];
  __shared__ uint32_t s_bucket;
  __shared__ double s_carried;
  const RowView r{static_cast<const char*>(a.logits) + row * a.row_stride * ElemSize(a.type), a.type, a.len,
                  a.temperature, -INFINITY};
  float keep = -INFINITY;
  const bool use_k = a.top_k > 0 && a.top_k < a.len;
  const bool use_p = a.top_p > 0.f && a.top_p < 1.f;
  if (use_k) {  // top-k: x >= k-th largest (ties kept)
    int64_t ties = 0;
    keep = FromKey(KthLargestKey(r, a.top_k, hist, &ties));
  }
  if (use_p) {
    // Over the top-k survivors, renormalised: keep each value whose mass
    // strictly above it is < top_p (the largest always). Radix search for
    // the smallest such value, digit by digit, carrying the mass of the
    // buckets above the chosen one. float64 as the CPU filter.
    float mt = -INFINITY;
    ForEachX(r, [&](float x, int64_t) {
      if (x >= keep) mt = fmaxf(mt, x);
    });
    const double mx = BlockMax(mt);
    double zt = 0.0;
    ForEachX(r, [&](float x, int64_t) {
      if (x >= keep) zt += exp(static_cast<double>(x) - mx);
    });
    const double z = BlockSum(zt);
    uint32_t prefix = 0, mask = 0;
    double carried = 0.0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) {
        hist[b] = 0;
        mass[b] = 0.0;
      }
      __syncthreads();
      ForEachX(r, [&](float x, int64_t) {
        if (!(x >= keep)) return;
        const uint32_t k = Key(x);
        if ((k & mask) != prefix) return;
        const uint32_t b = (k >> shift) & 0xffu;
        atomicAdd(&hist[b], 1u);
        atomicAdd(&mass[b], exp(static_cast<double>(x) - mx));
      });
      __syncthreads();
      if (threadIdx.x == 0) {
        double cum = carried, chosen_cum = carried;
        int chosen = -1;
        for (int b = kRadixBins - 1; b >= 0; --b) {
          if (hist[b] == 0) continue;
          if (chosen >= 0 && !(cum / z < a.top_p)) break;
          chosen = b;
          chosen_cum = cum;
          cum += mass[b];
        }
        s_bucket = static_cast<uint32_t>(chosen < 0 ? 0 : chosen);
        s_carried = chosen_cum;
      }
      __syncthreads();
      prefix |= s_bucket << shift;
      mask |= 0xffu << shift;
      carried = s_carried;
      __syncthreads();
    }
    keep = FromKey(prefix);
  }
  if (threadIdx.x == 0) a.keep_min[row] = keep;
}

}  // namespace

cudaError_t LaunchSamplingKeepMin(const FilterArgs& a, cudaStream_t stream) {
  if (a.rows <= 0) return cudaSuccess;
  const LaunchCheck<> check;  // reports this launch's error, not a stale one
  KeepMinKernel<<<static_cast<unsigned>(a.rows), kRowThreads, 0, stream>>>(a);
  return check.Result();
}

}  // namespace logprob::cuda
