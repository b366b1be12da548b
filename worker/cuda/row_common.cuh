// Device building blocks shared by the row kernels: reading x =
// logits / temperature (filtered by keep_min) with 16-byte loads, the
// order-preserving float key, and block-wide radix select over keys.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {

constexpr int kRowThreads = 256;
constexpr int kRadixBins = 256;

/// One row of a slice: len elements of `type` at `p`.
struct RowView {
  const char* p;
  ElemType type;
  int64_t len;
  float temperature;
  float keep_min;

  /// x before the filter (exactly as the CPU kernel: IEEE division by the
  /// temperature when != 1).
  __device__ __forceinline__ float Scale(float v) const { return temperature != 1.0f ? __fdiv_rn(v, temperature) : v; }
  /// The keep_min filter of a scaled x.
  __device__ __forceinline__ float Filter(float x) const { return x < keep_min ? -INFINITY : x; }
  /// x from an element value: Scale, then the keep_min filter.
  __device__ __forceinline__ float Post(float v) const { return Filter(Scale(v)); }
  /// Post (kFilter) or Scale only (!kFilter).
  template <bool kFilter>
  __device__ __forceinline__ float Out(float v) const {
    return kFilter ? Post(v) : Scale(v);
  }
  __device__ __forceinline__ float Raw(int64_t i) const {
    switch (type) {
      case ElemType::kF32:
        return reinterpret_cast<const float*>(p)[i];
      case ElemType::kBF16:
        return __uint_as_float(uint32_t{reinterpret_cast<const uint16_t*>(p)[i]} << 16);
      default:
        return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short*>(p)[i]));
    }
  }
  __device__ __forceinline__ float X(int64_t i) const { return Post(Raw(i)); }
};

/// Low / high 16-bit element of a 32-bit word as float.
__device__ __forceinline__ float Lo16(uint32_t w, ElemType t) {
  return t == ElemType::kBF16 ? __uint_as_float(w << 16)
                              : __half2float(__ushort_as_half(static_cast<unsigned short>(w)));
}
__device__ __forceinline__ float Hi16(uint32_t w, ElemType t) {
  return t == ElemType::kBF16 ? __uint_as_float(w & 0xffff0000u)
                              : __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}

/// Calls f(x, i) for every column i of the row, each once, spread over the
/// block's threads (16-byte loads for the aligned body; no order). x is
/// RowView::Post (kFilter, the default) or RowView::Scale (!kFilter: the
/// caller filters, e.g. to sum x before the filter too).
template <bool kFilter = true, typename F>
__device__ __forceinline__ void ForEachX(const RowView& r, F&& f) {
  const int esize = ElemSize(r.type);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(r.p);
  int64_t head = (addr % esize) ? r.len : static_cast<int64_t>(((16 - (addr & 15)) & 15) / esize);
  if (head > r.len) head = r.len;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) f(r.Out<kFilter>(r.Raw(i)), i);
  const int per = 16 / esize;
  const int64_t nvec = (r.len - head) / per;
  const uint4* v = reinterpret_cast<const uint4*>(r.p + head * esize);
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    const uint4 w = __ldg(v + j);
    const int64_t b = head + j * per;
    if (r.type == ElemType::kF32) {
      f(r.Out<kFilter>(__uint_as_float(w.x)), b);
      f(r.Out<kFilter>(__uint_as_float(w.y)), b + 1);
      f(r.Out<kFilter>(__uint_as_float(w.z)), b + 2);
      f(r.Out<kFilter>(__uint_as_float(w.w)), b + 3);
    } else {
      const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f(r.Out<kFilter>(Lo16(ws[k], r.type)), b + 2 * k);
        f(r.Out<kFilter>(Hi16(ws[k], r.type)), b + 2 * k + 1);
      }
    }
  }
  for (int64_t i = head + nvec * per + threadIdx.x; i < r.len; i += blockDim.x) f(r.Out<kFilter>(r.Raw(i)), i);
}

/// Order-preserving key: a > b (floats, -0 == +0) iff Key(a) > Key(b);
/// every NaN (any sign or payload) is the largest key, above +inf: the
/// order of top-k (as torch.topk; the CPU kernel's OrderKey in
/// worker/kernels/row_stats.cc), a total order where float comparisons are
/// all false for NaN.
__device__ __forceinline__ uint32_t Key(float x) {
  if (x != x) return 0xffffffffu;
  if (x == 0.0f) x = 0.0f;  // -0 and +0 tie, as in float comparisons
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float FromKey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/// Block-wide max of per-thread values (all threads get it).
__device__ __forceinline__ float BlockMax(float v) {
  __shared__ float warp_max[kRowThreads / 32];
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  float m = warp_max[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = fmaxf(m, warp_max[w]);
  __syncthreads();
  return m;
}

/// Block-wide sum in float64 (all threads get it).
__device__ __forceinline__ double BlockSum(double v) {
  __shared__ double warp_sum[kRowThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) s += warp_sum[w];
  __syncthreads();
  return s;
}

/// Counts, in hist[256], the keys of the row matching `prefix` under
/// `mask`, by their digit at `shift`. Ends with a barrier.
__device__ __forceinline__ void DigitHistogram(const RowView& r, uint32_t prefix, uint32_t mask, int shift,
                                               unsigned* hist) {
  for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  ForEachX(r, [&](float x, int64_t) {
    const uint32_t k = Key(x);
    if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 0xffu], 1u);
  });
  __syncthreads();
}

/// Walks the bins hi, hi - 1, ..., lo of `hist` down from the top, adding
/// their counts to *cum, and returns the first bin b where *cum + hist[b]
/// >= k (lo if none); *cum is then the count in the bins above b.
__device__ __forceinline__ int BinOfKth(const unsigned* hist, int hi, int lo, int64_t k, int64_t* cum) {
  int b = hi;
  for (; b > lo; --b) {
    if (*cum + hist[b] >= k) break;
    *cum += hist[b];
  }
  return b;
}

/// Radix select: the key of the k-th largest x of the row (1 <= k <= len),
/// and in *ties how many entries equal to it are among the k largest.
/// `hist` is kRadixBins shared counters (scratch). Four passes over the row.
__device__ __forceinline__ uint32_t KthLargestKey(const RowView& r, int64_t k, unsigned* hist, int64_t* ties) {
  __shared__ uint32_t s_bucket;
  __shared__ int64_t s_k;
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    DigitHistogram(r, prefix, mask, shift, hist);
    if (threadIdx.x == 0) {
      int64_t cum = 0;
      s_bucket = static_cast<uint32_t>(BinOfKth(hist, kRadixBins - 1, 0, k, &cum));
      s_k = k - cum;
    }
    __syncthreads();
    prefix |= s_bucket << shift;
    mask |= 0xffu << shift;
    k = s_k;
    __syncthreads();
  }
  *ties = k;
  return prefix;
}

}  // namespace logprob::cuda
