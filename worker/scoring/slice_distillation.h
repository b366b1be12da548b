// The seam of full-vocabulary distillation on one worker (issue 48): one
// work item's rounds over the worker's vocabulary slice of two heads, the
// student's (which gets gradients) and the teacher's (never updated), on
// whatever computes them (the CPU: cpu_slice_distillation.h). The caller
// (divergence_pass.h) runs the collectives between the steps of a round:
// the slices' first-round partials go to every worker and combine in rank
// order into each row's log-normalisers and closed-form divergences; the
// JSD's second-round partials likewise. Math: worker/kernels/divergence.h.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/kernels/divergence.h"

namespace logprob {

/// A round's rows of both models (host memory, readable until the round's
/// last step returns), [m] rows each.
struct DistillationRound {
  DType student_dtype = v1::F32;         // F32, BF16 or F16
  const void* student_hidden = nullptr;  // [m, H_s]
  DType teacher_dtype = v1::F32;
  const void* teacher_hidden = nullptr;  // [m, H_t]
  int64_t m = 0;
};

/// One work item's distillation over a vocabulary slice of both heads
/// (the same vocabulary columns). Rounds of Partials, then JsdPartials
/// (0 < beta < 1 only), then Gradients (a backward only); Flush once after
/// the last round. Not thread-safe: one item, one thread.
class SliceDistillation {
 public:
  virtual ~SliceDistillation() = default;
  virtual int64_t rows() const = 0;                 // the slice's vocabulary rows
  virtual int64_t student_hidden_size() const = 0;  // H_s
  virtual int64_t teacher_hidden_size() const = 0;  // H_t

  /// Round step 1: both models' transformed logits of the round's rows on
  /// the slice (their heads' GEMMs and transforms, kept for the next
  /// steps) and each row's first-round partial, out [round.m].
  /// INVALID_ARGUMENT for bad arguments; the GEMMs' errors otherwise.
  virtual absl::Status Partials(const DistillationRound& round, float temperature, kernels::DivergencePartial* out) = 0;

  /// Round step 2 (the JSD): each row's second-round partial from its
  /// combined lse_s, lse_t ([m] each); out [m]. FAILED_PRECONDITION
  /// without a Partials before it.
  virtual absl::Status JsdPartials(float temperature, double beta, const double* lse_s, const double* lse_t,
                                   kernels::JsdPartial* out) = 0;

  /// Round step 3 (a backward): from each row's gradient values (`rows`
  /// [m]), writes the slice's share of the student's dL/dh to
  /// grad_hidden [m, H_s] (f32) and, when grad_weight is non-null, adds the
  /// student's dL/dW to grad_weight [rows(), H_s] and dL/db to grad_bias
  /// [rows()] (null: no bias) by the time Flush returns. A row's share is
  /// bitwise the same whatever the other rows. FAILED_PRECONDITION without
  /// a Partials before it.
  virtual absl::Status Gradients(float temperature, double beta, const kernels::DivergenceGradRow* rows,
                                 float* grad_hidden, float* grad_weight, float* grad_bias) = 0;

  /// Adds what the rounds left to add (the same pointers as Gradients').
  virtual absl::Status Flush(float* grad_weight, float* grad_bias) = 0;
};

}  // namespace logprob
