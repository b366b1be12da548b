// Launchers of the CUDA row kernels (row_partials.cu, sampling_filter.cu,
// dtype_convert.cu). Plain types only: included by nvcc and g++ alike.
//
// The records have the layout of worker/kernels/partial_record.h (the
// CPU kernel's): x = logits / temperature with entries below the row's
// keep_min removed (-inf); record::kAbsentXBits for ids outside the slice;
// top-k best first (larger x, then lower id), padded with
// (-inf, record::kNoTopkId). s, u, q and zsum come from per-thread float
// sums combined in float64 (the CPU kernel sums differently: equal within
// float32 rounding, not bitwise); m, target_x, pre_target_max, gather_x and
// the top-k are bitwise those of the CPU kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "worker/kernels/partial_record.h"

namespace logprob::cuda {

/// Element type of logits / hidden states on the device.
enum class ElemType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

/// Bytes per element.
LOGPROB_HOST_DEVICE inline int ElemSize(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

/// A block of rows on the device and what to compute for them.
struct RowBlockArgs {
  const void* logits = nullptr;  // device, rows x row_stride elements of `type`
  ElemType type = ElemType::kF32;
  int64_t row_stride = 0;   // elements between consecutive rows
  int64_t len = 0;          // columns of the slice (<= row_stride)
  int64_t vocab_begin = 0;  // global id of column 0
  int64_t rows = 0;
  const int64_t* targets = nullptr;     // device [rows]; < 0: none
  const int64_t* gather_ids = nullptr;  // device [rows, gather_k] or null
  const float* keep_min = nullptr;      // device [rows] or null (no filter)
  float temperature = 1.0f;
  int entropy = 0;
  int log_sum_sq_probs = 0;  // record field q
  int mean_logits = 0;       // record field zsum (x before the filter)
  int is_top1 = 0;           // record field pre_target_max
  int topk = 0;
  int gather_k = 0;
  uint32_t* records = nullptr;      // device [rows, record::Words(gather_k, topk)]
  float* topk_scratch_x = nullptr;  // device [rows, topk] when topk > 0
  int32_t* topk_scratch_id = nullptr;
};

/// One block per row: one pass (online softmax, float32 per thread,
/// float64 across threads) for m, s, u and, when asked, q (= sum e^2,
/// rescaled like s), zsum (float32 per thread) and pre_target_max (bitwise
/// the CPU kernel's); the target and gather x; the top-k
/// (topk_select.cuh: a coarse key histogram fused into the pass, then one
/// candidate pass, or radix select when the k-th value's bucket holds more
/// than 2048 entries). Asynchronous on `stream`.
cudaError_t LaunchRowPartials(const RowBlockArgs& args, cudaStream_t stream);

/// Sampling filters of full rows (kernels::SamplingKeepMin semantics):
/// writes keep_min[row], the smallest x = logits / temperature that
/// survives top-k (ties kept; radix select of the k-th largest) then top-p
/// (radix search over the probability mass strictly above each value).
struct FilterArgs {
  const void* logits = nullptr;  // device, rows x row_stride
  ElemType type = ElemType::kF32;
  int64_t row_stride = 0, len = 0, rows = 0;
  float temperature = 1.0f;
  int top_k = 0;              // <= 0 or >= len: off
  float top_p = 1.0f;         // outside (0, 1): off
  float* keep_min = nullptr;  // device [rows]
};
cudaError_t LaunchSamplingKeepMin(const FilterArgs& args, cudaStream_t stream);

/// dst[n] = src[n] converted: to bf16 (round to nearest even, f16 through
/// f32 exactly) or to f32 (exact). dst_type is kBF16 or kF32.
/// Test hook (CudaBackend::Options::trap_file): one thread that executes
/// `__trap()`, a device fault that leaves the context unusable (the next
/// synchronisation reports a sticky error). Asynchronous on `stream`.
cudaError_t LaunchTrap(cudaStream_t stream);

cudaError_t LaunchConvert(const void* src, ElemType src_type, int64_t n, void* dst, ElemType dst_type,
                          cudaStream_t stream);

}  // namespace logprob::cuda
