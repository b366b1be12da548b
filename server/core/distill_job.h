// Full-vocabulary distillation requests (DistillRequest, issue 48,
// docs/distillation.md): validation, the split over the workers and the
// answer. A request is one work item per worker, not batched with others:
// worker w gets rows SplitRange(N, W, w) of both models' hidden states and
// holds vocabulary rows SplitRange(V, W, w) of both heads
// (worker/gradients/distillation_item.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.pb.h"
#include "logprob/v1/logprob.pb.h"
#include "server/core/score_job.h"
#include "server/heads/lm_heads.h"
#include "server/pool/plan.h"

namespace logprob {

/// A validated DistillRequest; its byte views point into the request,
/// which must outlive the job.
struct DistillJob {
  int64_t rows = 0;                                       // N
  int64_t vocab_size = 0;                                 // V (both heads')
  std::shared_ptr<const LmHeadVersion> student, teacher;  // bound at admission
  DType student_dtype = v1::F32, teacher_dtype = v1::F32;
  int64_t student_hidden = 0, teacher_hidden = 0;  // H_s, H_t
  std::string_view student_bytes, teacher_bytes;   // [N, H] each, row-major
  double beta = 0.0;
  float temperature = 1.0f;
  bool backward = false;                                   // grad_divergence given
  std::vector<float> grad_divergence, grad_cross_entropy;  // [N] each (grad_cross_entropy may be empty)
  std::string gradient_step;

  /// Bytes the front-end holds beyond the request while it runs: the
  /// work items' copies of both models' rows and of the upstream gradients
  /// (each worker gets all N), their serialized form, and the answer's
  /// outputs (built, then serialized), for `workers` workers.
  int64_t working_bytes(int workers) const;
};

/// Validates `req` against the heads: INVALID_ARGUMENT naming the field
/// (and the position) for an unknown or duplicate input, one not in
/// `data`, a wrong dtype or shape, a size not matching the shape, hidden
/// sizes not their heads', heads of different vocabularies, more rows than
/// limits.max_tokens, beta outside [0, 1], a temperature not > 0, a
/// non-finite upstream gradient, grad_cross_entropy or gradient_step
/// without grad_divergence, a malformed gradient step key;
/// FAILED_PRECONDITION without lm_heads (and a pinned version no longer
/// held); NOT_FOUND for an unknown head.
absl::StatusOr<DistillJob> BuildDistillJob(const v1::DistillRequest& req, const LmHeads* heads,
                                           const RequestLimits& limits);

/// The job's work items, one per worker (HIDDEN_STATES, the payload in
/// `data`).
Plan PlanDistillation(const DistillJob& job, int workers, uint64_t job_id);

/// The answer from the workers' results (each worker's rows). INTERNAL
/// when a result does not cover its rows.
absl::StatusOr<v1::DistillResponse> DistillResponseOf(const std::string& id, const DistillJob& job,
                                                      const std::vector<internal::v1::WorkResult>& results);

}  // namespace logprob
