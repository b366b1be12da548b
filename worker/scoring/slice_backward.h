// The seam of the lm_head's backward on one worker (issue 47): one work
// item's rounds over the worker's vocabulary slice, whatever computes them
// (oneDNN on the CPU: cpu_slice_backward.h; cuBLASLt on the GPU:
// worker/cuda/cuda_slice_backward.h). The caller (backward_pass.h) runs the
// collectives between the two steps of a round: the slice's partial
// records of the round's rows go to every worker, and the whole
// vocabulary's log-normaliser and entropy come back (combined in rank
// order, so exactly the forward's). Math: worker/kernels/head_backward.h.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/lm_head_transform.h"
#include "worker/kernels/head_backward.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/kernels/row_stats.h"

namespace logprob {

/// The arguments of SliceBackward::Records every backend refuses alike:
/// INVALID_ARGUMENT for m < 0, null buffers with rows, a hidden dtype not
/// F32, BF16 or F16, or a spec with top-k or gathered ids.
inline absl::Status CheckRecordsCall(DType hidden_dtype, const void* hidden, int64_t m, const kernels::StatsSpec& spec,
                                     const uint32_t* records) {
  if (m < 0 || (m > 0 && (hidden == nullptr || records == nullptr)))
    return absl::InvalidArgumentError(absl::StrCat("backward records: ", m, " rows, or null buffers"));
  if (spec.topk != 0 || spec.gather_k != 0)
    return absl::InvalidArgumentError("backward records have no top-k or gathered ids");
  return kernels::CheckHiddenStatesDType(hidden_dtype);
}

/// One work item's backward over an lm_head slice (ScoringBackend::
/// HeadBackward): rounds of Records then Gradients, then Flush once. Not
/// thread-safe: one item, one thread.
class SliceBackward {
 public:
  virtual ~SliceBackward() = default;
  virtual int64_t rows() const = 0;         // the slice's vocabulary rows
  virtual int64_t hidden_size() const = 0;  // H
  virtual int64_t vocab_begin() const = 0;  // global id of the slice's first row
  virtual float temperature() const = 0;

  /// Round step 1: the transformed logits of `m` rows hidden[m, H]
  /// (`hidden_dtype` F32, BF16 or F16, host memory, kept readable until
  /// Gradients returns) on the slice, with the forward's GEMM and transform
  /// (its bits), kept for Gradients; writes their partial records
  /// [m][kernels::PartialWords(spec)] (host) with the targets [m] (global
  /// ids, < 0: none) as the forward's kernel of this backend computes them.
  /// INVALID_ARGUMENT for bad arguments (a spec with top-k or gathered
  /// ids among them); the GEMM's errors otherwise.
  virtual absl::Status Records(DType hidden_dtype, const void* hidden, int64_t m, const int64_t* targets,
                               const kernels::StatsSpec& spec, uint32_t* records) = 0;

  /// Round step 2, for the rows of the last Records: from their whole
  /// vocabulary's lse and entropy, the upstream gradients and the targets
  /// (`rows`, [m] each: the targets those Records got), writes the slice's share of dL/dh to grad_hidden [m, H] (f32,
  /// host) and, when grad_weight is non-null, adds dL/dW to grad_weight
  /// [rows(), H] and dL/db to grad_bias [rows()] (f32, host; null: no bias)
  /// by the time Flush returns (a backend may sum an item's rounds where it
  /// computes them). A row's share is bitwise the same whatever the other
  /// rows. FAILED_PRECONDITION without a Records before it.
  virtual absl::Status Gradients(const kernels::BackwardRows& rows, float* grad_hidden, float* grad_weight,
                                 float* grad_bias) = 0;

  /// Adds what the rounds left to add to grad_weight / grad_bias (the same
  /// pointers every Gradients was given); after the last round of an item.
  virtual absl::Status Flush(float* grad_weight, float* grad_bias) = 0;
};

}  // namespace logprob
