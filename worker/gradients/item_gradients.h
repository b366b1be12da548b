// What the gradient items of a worker group share (worker/gradients/
// backward_item.h, the policy head's backward; distillation_item.h, the
// student's): the dL/dh shares of a round's rows sent to the rows' owners
// and summed in rank order, and a step's sums added to only when every
// rank may add (so one rank's refusal fails the item everywhere and adds
// nothing anywhere).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/comm/communicator.h"
#include "worker/gradients/head_gradient_steps.h"

namespace logprob {

/// One all-to-all of a round: `share` [Σ count, H] (f32) holds this rank's
/// slice's share of dL/dh of every rank's rows of the round, packed in rank
/// order (count[q] rows of rank q); `out` [count[rank], H] receives the sum
/// over every slice's share of this rank's rows, in rank order (the same
/// bits whatever else was in the round). `recv`: scratch. The
/// communicator's errors.
absl::Status SumSharesToOwners(Communicator& comm, const std::vector<int64_t>& count, int64_t H, const float* share,
                               std::vector<float>* recv, float* out);

/// What an item's rounds report to AddToStepAgreed.
struct ItemRounds {
  /// Runs the rounds, adding the slice's dL/dW, dL/db to `weight` [rows,
  /// H] and `bias` ([rows] or null).
  std::function<absl::Status(float* weight, float* bias)> run;
  /// True once a round began adding (a failure before leaves the step's
  /// sums as they were).
  std::function<bool()> added;
};

/// Runs `rounds` without sums (null pointers) when `step` is empty; else
/// with the sums of gradient step `step` of `steps` for
/// head version (head, version) (its slice `rows` x `hidden_size`, with
/// a bias or not; `tokens` rows of the item), every rank of `comm`
/// agreeing first that all of them took the step (HeadGradientSteps::
/// Accumulate): one rank's refusal fails the item on every rank with
/// ABORTED (its own error on that rank) and nothing is added. An item
/// that fails before its rounds began adding leaves the step as it was.
/// All ranks must call it with the same step.
absl::Status AddToStepAgreed(HeadGradientSteps& steps, Communicator& comm, const std::string& step,
                             const std::string& head, const std::string& version, int64_t rows, int64_t hidden_size,
                             bool bias, int64_t tokens, const ItemRounds& rounds);

}  // namespace logprob
