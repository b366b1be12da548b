// Block-wide top-k of one row for the GPU record: a coarse histogram of
// the keys (fused into the statistics pass) locates the k-th largest
// value's bucket; its candidates are ranked in shared memory, or, when the
// bucket is large, radix select (row_common.cuh) finds the k-th largest key
// exactly. A rank sort puts the k winners in "best first" order (larger x,
// then lower id: the CPU kernel's order, so the selected ids are bitwise
// the same). Every comparison is of Key (row_common.cuh): NaN ranks above
// every number and ties with NaN by id (issue 50: float comparisons, all
// false for NaN, gave NaN candidates equal ranks and left other top-k slots
// unwritten, holding the previous request's bytes).
#pragma once

#include <cub/block/block_scan.cuh>

#include "worker/cuda/row_common.cuh"

namespace logprob::cuda {

/// Bins of the coarse histogram fused into the statistics pass: the top
/// kTopkBinBits bits of Key (sign, exponent, 2 mantissa bits: quarter
/// octaves).
constexpr int kTopkBinBits = 11;
constexpr int kTopkBins = 1 << kTopkBinBits;
/// Candidates of the coarse bucket that a row's k-th largest value falls
/// in, kept in shared memory for the fast path.
constexpr int kTopkCandidates = 2048;

/// Writes the row's top-`topk` (x, global id) best first into tv / ti,
/// padded with (-inf, record::kNoTopkId) when the slice is shorter than topk.
/// `hist` holds the coarse histogram of the row (kTopkBins bins of
/// Key >> (32 - kTopkBinBits)).
/// cx / cid are topk entries of global scratch. Called by every thread of
/// the block.
///
/// Fast path (the k-th largest's coarse bucket holds at most
/// kTopkCandidates entries, the usual case): one more pass over the row
/// keeps the entries of higher buckets (all selected) and those of that
/// bucket (candidates, in shared memory), and the candidates are ranked
/// among themselves. Otherwise (e.g. many equal values): radix select of
/// the k-th largest key (four 8-bit digit passes), then one ordered pass
/// that takes the entries above it and the lowest-id entries equal to it.
__device__ __forceinline__ void BlockTopK(const RowView& r, int64_t vocab_begin, int topk, unsigned* hist, float* cx,
                                          int32_t* cid, float* tv, int32_t* ti) {
  using Scan = cub::BlockScan<int, kRowThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ float cand_x[kTopkCandidates];
  __shared__ int32_t cand_id[kTopkCandidates];
  __shared__ unsigned group[kRowThreads];
  __shared__ unsigned digit_hist[kRadixBins];
  __shared__ int n_greater, n_cand;
  __shared__ uint32_t s_top;
  __shared__ int64_t s_above;
  constexpr int kPerGroup = kTopkBins / kRowThreads;
  const int64_t k_eff = r.len < topk ? r.len : topk;
  if (k_eff > 0) {
    // The bucket of the k-th largest: group sums, then a walk from the top.
    unsigned sum = 0;
    for (int b = 0; b < kPerGroup; ++b) sum += hist[threadIdx.x * kPerGroup + b];
    group[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t cum = 0;
      const int g = BinOfKth(group, kRowThreads - 1, 0, k_eff, &cum);
      s_top = static_cast<uint32_t>(BinOfKth(hist, g * kPerGroup + kPerGroup - 1, g * kPerGroup, k_eff, &cum));
      s_above = cum;
      n_greater = 0;
      n_cand = 0;
    }
    __syncthreads();
    const uint32_t top = s_top;
    const int64_t above = s_above;
    if (hist[top] <= static_cast<unsigned>(kTopkCandidates)) {
      ForEachX(r, [&](float x, int64_t i) {
        const uint32_t t = Key(x) >> (32 - kTopkBinBits);
        if (t > top) {
          const int slot = atomicAdd(&n_greater, 1);
          cx[slot] = x;
          cid[slot] = static_cast<int32_t>(vocab_begin + i);
        } else if (t == top) {
          const int slot = atomicAdd(&n_cand, 1);
          cand_x[slot] = x;
          cand_id[slot] = static_cast<int32_t>(vocab_begin + i);
        }
      });
      __syncthreads();
      const int n = n_cand;
      const int64_t need = k_eff - above;
      for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float xj = cand_x[j];
        const uint32_t kj = Key(xj);
        const int32_t ij = cand_id[j];
        int64_t rank = 0;
        for (int i = 0; i < n; ++i) {
          const uint32_t ki = Key(cand_x[i]);
          rank += (ki > kj || (ki == kj && cand_id[i] < ij)) ? 1 : 0;
        }
        if (rank < need) {
          cx[above + rank] = xj;
          cid[above + rank] = ij;
        }
      }
    } else {
      int64_t ties = 0;
      const uint32_t kth = KthLargestKey(r, k_eff, digit_hist, &ties);
      const int64_t greater = k_eff - ties;
      int64_t tie_base = 0;
      for (int64_t t0 = 0; t0 < r.len; t0 += blockDim.x) {
        const int64_t i = t0 + threadIdx.x;
        const bool valid = i < r.len;
        const float x = valid ? r.X(i) : 0.0f;
        const uint32_t key = Key(x);
        if (valid && key > kth) {
          const int slot = atomicAdd(&n_greater, 1);
          cx[slot] = x;
          cid[slot] = static_cast<int32_t>(vocab_begin + i);
        }
        const bool tie = valid && key == kth;
        int rank = 0, total = 0;
        Scan(scan_tmp).ExclusiveSum(tie ? 1 : 0, rank, total);
        if (tie && tie_base + rank < ties) {
          cx[greater + tie_base + rank] = x;
          cid[greater + tie_base + rank] = static_cast<int32_t>(vocab_begin + i);
        }
        tie_base += total;
        __syncthreads();
      }
    }
  }
  __syncthreads();
  // Rank sort of the k_eff candidates (unique ids: a total order).
  for (int64_t j = threadIdx.x; j < k_eff; j += blockDim.x) {
    const float xj = cx[j];
    const uint32_t kj = Key(xj);
    const int32_t ij = cid[j];
    int64_t rank = 0;
    for (int64_t i = 0; i < k_eff; ++i) {
      const uint32_t ki = Key(cx[i]);
      rank += (ki > kj || (ki == kj && cid[i] < ij)) ? 1 : 0;
    }
    tv[rank] = xj;
    ti[rank] = ij;
  }
  for (int64_t j = k_eff + threadIdx.x; j < topk; j += blockDim.x) {
    tv[j] = -INFINITY;
    ti[j] = record::kNoTopkId;
  }
}

}  // namespace logprob::cuda
