// One rank's share of a distillation work item (WorkItem.distillation,
// issue 48): full-vocabulary divergences between a student head and a
// teacher head over a HIDDEN_STATES item, vocabulary-parallel, and on
// request the student's backward.
//
// Rounds of rows as the backward's (backward_item.h): every rank
// contributes up to hidden_chunk_tokens of its own rows of both models'
// hidden states and all-gathers them (collectives 1 and 2); its
// divergence pass (worker/scoring/divergence_pass.h) computes both models'
// logits on its slices and all-gathers the rows' partials (collective 3;
// the JSD a fourth), which give every row's divergence, cross entropy and
// student entropy; with a backward, its slice's share of the student's
// dL/dh of every row of the round and its dL/dW, dL/db added to the item's
// gradient step; one all-to-all (the last collective) brings each rank its
// rows' shares from every slice, summed in rank order. A row's outputs and
// dL/dh are bitwise the same whatever else is in the batch (given the
// worker count).
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/gradients/head_gradient_steps.h"
#include "worker/scoring/backend.h"
#include "worker/scoring/scorer.h"

namespace logprob {

/// Runs this rank's share of the distillation item `item` (HIDDEN_STATES,
/// item.distillation() set; the student's hidden rows SplitRange(num_rows,
/// W, rank) at `payload`, host memory; the teacher's in
/// item.distillation().teacher_data()) on this rank's slices `student` and
/// `teacher` of the two heads with `backend` (ScoringBackend::
/// HeadDistillation). Returns the rows it owns: divergence, cross_entropy
/// and entropy (the student's) and, with item.backward(),
/// grad_hidden_states [own rows, H_s] (f32). With a backward and
/// options().gradient_step set, adds the student slice's dL/dW and dL/db
/// to that step of `steps` as the policy backward does (AddToStepAgreed).
/// `should_stop` as ScoreWorkItem (the ranks agree per round). Errors:
/// INVALID_ARGUMENT for an inconsistent item (layout, sizes, beta outside
/// [0, 1], upstream gradients of another length or not finite, sampling
/// filters, masks or other outputs, a CUDA IPC payload, slices of other
/// rows); the gradient step's errors; FAILED_PRECONDITION from a backend
/// without distillation; CANCELLED; the collectives' errors. All ranks
/// must call it with the same item.
absl::StatusOr<internal::v1::WorkResult> RunDistillationItem(const internal::v1::WorkItem& item, ItemPayload payload,
                                                             Communicator& comm, ScoringBackend& backend,
                                                             int64_t hidden_chunk_tokens,
                                                             const std::function<bool()>& should_stop,
                                                             const LmHeadWeights* student, const LmHeadWeights* teacher,
                                                             HeadGradientSteps& steps);

}  // namespace logprob
