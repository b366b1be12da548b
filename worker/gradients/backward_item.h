// One rank's share of a backward work item (WorkItem.backward, issue 47):
// the lm_head's backward over a HIDDEN_STATES item, vocabulary-parallel.
//
// Rounds of rows as the forward's (worker/scoring/scorer.cc
// ScoreHiddenStates): every rank contributes up to hidden_chunk_tokens of
// its own hidden rows and all-gathers the round's rows (collective 1); its
// backward pass (worker/scoring/backward_pass.h) recomputes the round's
// logits on its slice and all-gathers the rows' partial records
// (collective 2), which give every row's log-normaliser and entropy as the
// forward computed them; then it has its slice's share of dL/dh of every
// row of the round and adds its slice's dL/dW, dL/db to the item's
// gradient step. One all-to-all (collective 3) brings each rank the
// shares of its own rows from every slice, summed in rank order: three
// collectives per round, and a row's dL/dh is bitwise the same whatever
// else is in the batch (given the worker count).
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

/// Runs this rank's share of the backward item `item` (item.backward(),
/// HIDDEN_STATES, its hidden rows SplitRange(num_rows, W, rank) at
/// `payload`, host memory) on this rank's slice `lm_head` with `backend`
/// (ScoringBackend::HeadBackward). Returns the rows it owns:
/// token_logprobs (and entropy when item.options().entropy()) and
/// grad_hidden_states [own rows, H] (f32). With options().gradient_step
/// set, adds the slice's dL/dW and dL/db to that step of `steps` (opened
/// by its first backward for the item's head version; the ranks agree
/// that every one of them may add before any does, so one rank's refusal
/// fails the item on all of them and adds nothing anywhere). An item that
/// fails (stopped, a collective lost) after its first round began adding
/// drops the step on that rank (its sums are unknown); before, the step
/// stays as it was.
/// `should_stop` as ScoreWorkItem (the ranks agree per round). Errors:
/// INVALID_ARGUMENT for an item that is not a consistent backward (wrong
/// layout or sizes, sampling filters or masks, outputs other than
/// token_logprobs and entropy, a CUDA IPC payload); the gradient step's
/// errors (HeadGradientSteps::Accumulate); FAILED_PRECONDITION from a
/// backend without a backward; CANCELLED; the collectives' errors. All
/// ranks must call it with the same item.
absl::StatusOr<internal::v1::WorkResult> RunBackwardItem(const internal::v1::WorkItem& item, ItemPayload payload,
                                                         Communicator& comm, ScoringBackend& backend,
                                                         int64_t hidden_chunk_tokens,
                                                         const std::function<bool()>& should_stop,
                                                         const LmHeadWeights* lm_head, HeadGradientSteps& steps);

}  // namespace logprob
