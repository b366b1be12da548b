// Block-wide top-k of one row for the GPU record: radix select of the
// k-th largest key (row_common.cuh), one ordered pass that collects the
// entries above it and the lowest-id entries equal to it, and a rank sort
// into "best first" order (larger x, then lower id: the CPU kernel's order,
// so the selected ids are bitwise the same).
#pragma once

#include <cub/block/block_scan.cuh>

#include "worker/cuda/row_common.cuh"

namespace logprob::cuda {

/// Writes the row's top-`topk` (x, global id) best first into tv / ti,
/// padded with (-inf, kNoTopkId) when the slice is shorter than topk.
/// `hist` holds the first-digit histogram of the row's keys. cx / cid are
/// topk entries of global scratch. Called by every thread of the block.
__device__ __forceinline__ void BlockTopK(const RowView& r, int64_t vocab_begin, int topk, unsigned* hist, float* cx,
                                          int32_t* cid, float* tv, int32_t* ti) {
  using Scan = cub::BlockScan<int, kRowThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int n_greater;
  const int64_t k_eff = r.len < topk ? r.len : topk;
  if (k_eff > 0) {
    int64_t ties = 0;
    const uint32_t kth = KthLargestKey(r, k_eff, hist, /*prefilled=*/true, &ties);
    const int64_t greater = k_eff - ties;
    if (threadIdx.x == 0) n_greater = 0;
    __syncthreads();
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
  __syncthreads();
  // Rank sort of the k_eff candidates (unique ids: a total order).
  for (int64_t j = threadIdx.x; j < k_eff; j += blockDim.x) {
    const float xj = cx[j];
    const int32_t ij = cid[j];
    int64_t rank = 0;
    for (int64_t i = 0; i < k_eff; ++i) {
      const float xi = cx[i];
      rank += (xi > xj || (xi == xj && cid[i] < ij)) ? 1 : 0;
    }
    tv[rank] = xj;
    ti[rank] = ij;
  }
  for (int64_t j = k_eff + threadIdx.x; j < topk; j += blockDim.x) {
    tv[j] = -INFINITY;
    ti[j] = kNoTopkId;
  }
}

}  // namespace logprob::cuda
