// Assembles the public ScoreResponse from the workers' per-row results.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.pb.h"
#include "logprob/v1/logprob.pb.h"
#include "server/core/planner.h"
#include "server/core/score_job.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// Appends a zero-filled output tensor `name` of `dtype`, shape
/// [out_shape (, k when k >= 0)], n * max(k, 1) elements of T, to `resp`
/// and returns its data (valid until resp's outputs change).
template <typename T>
T* AddOutput(v1::ScoreResponse* resp, const std::string& name, v1::DType dtype, const std::vector<int64_t>& out_shape,
             int64_t k, int64_t n) {
  v1::Tensor* t = resp->add_outputs();
  t->set_name(name);
  t->set_dtype(dtype);
  for (int64_t d : out_shape) t->add_shape(d);
  if (k >= 0) t->add_shape(k);
  t->mutable_data()->assign(static_cast<size_t>(n * std::max<int64_t>(k, 1)) * sizeof(T), '\0');
  return reinterpret_cast<T*>(t->mutable_data()->data());
}

/// Scatters the rows of `results` (one per plan item, in plan order) to
/// their output positions and returns the output tensors: token_logprobs
/// [out_shape] F32, and on request entropy, log_sum_sq_probs and
/// mean_logits [out_shape] F32, is_top1 [out_shape] I32 (0/1), topk_logprobs / topk_indices
/// (I64) [out_shape, K], gathered_logprobs [out_shape, gather_k]. Positions
/// that are not scored (past seq_lens) are 0. When `plan` scored a batch of
/// several jobs (server/core/batcher.h), `job`'s rows are the plan's rows
/// [row_begin, row_begin + job.num_rows()) and the others are skipped.
/// INTERNAL if the results do not cover every row of `job` exactly once.
absl::StatusOr<v1::ScoreResponse> BuildResponse(const ScoreJob& job, const Plan& plan,
                                                const std::vector<internal::v1::WorkResult>& results,
                                                int64_t row_begin = 0);

/// OK when every value of `resp`'s token_logprobs and entropy is finite
/// (or a -inf token logprob: a target the sampling filters excluded). For
/// hidden states the inputs are finite (checked on arrival), so a NaN or
/// another infinity means the head's logits overflowed float32 (weights, a
/// bias or a logit scale too large): FAILED_PRECONDITION naming the head,
/// its version and the first such token's index in `out_shape`, never a
/// NaN answered OK. Pure.
absl::Status CheckFiniteHiddenOutputs(const v1::ScoreResponse& resp, const std::vector<int64_t>& out_shape,
                                      const LmHeadVersion& head);

}  // namespace logprob
