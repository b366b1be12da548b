// One worker's share of the lm_head's backward over a batch of rows (issue
// 47): vocabulary-parallel, stateless. Rounds of rows: each worker computes
// its slice's logits once (the forward's GEMM and transform, so the same
// bits) and their partial records (SliceBackward::Records, on the CPU or
// the GPU), and one all-gather gives every worker every slice's records;
// combined in rank order they give each row's log-normaliser and entropy
// exactly as the forward computed them. The slice's gradients then follow
// with no further collective (SliceBackward::Gradients; the math:
// worker/kernels/head_backward.h): its share of dL/dh, which the caller
// sums over workers in rank order, and its rows' dL/dW and dL/db. The
// client sends no forward statistics, so they can never disagree with the
// hidden states.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"
#include "worker/scoring/slice_backward.h"

namespace logprob {

/// A backward's rows, [rows] each unless said otherwise, in row order; the
/// same on every worker of the group.
struct BackwardPassRows {
  DType hidden_dtype = v1::F32;  // F32, BF16 or F16
  const void* hidden = nullptr;  // [rows, H]
  int64_t rows = 0;
  const int64_t* targets = nullptr;      // global ids; < 0: no logprob term
  const float* grad_logprobs = nullptr;  // dL/dlogprob; null: 0
  const float* grad_entropy = nullptr;   // dL/dentropy; null: 0
  int64_t round_rows = 128;              // rows per round (--hidden-chunk-tokens)
};

/// Runs this worker's share of the backward of `in` on the slice of
/// `backward` (its GEMM, bias, transform, first id and temperature) of a
/// `vocab_size` vocabulary, with `comm` the group of every slice (one
/// all-gather per round). Writes its share of dL/dh to grad_hidden [rows, H] (f32)
/// and, when non-null, adds dL/dW to grad_weight [slice rows, H] and dL/db
/// to grad_bias [slice rows] by the time backward.Flush returns (the
/// caller flushes once, after the item's last pass). Every worker must call it with the same rows
/// and round_rows. A row's share is bitwise the same whatever else is in
/// the batch (given the worker count). When non-null, token_logprobs and
/// entropy [rows] receive the forward's values of the rows (what a
/// forward of the same rows answers, bit for bit). INVALID_ARGUMENT for
/// bad arguments; the communicator's or the GEMM's errors otherwise.
absl::Status RunBackwardPass(const BackwardPassRows& in, SliceBackward& backward, int64_t vocab_size,
                             Communicator& comm, float* grad_hidden, float* grad_weight, float* grad_bias,
                             float* token_logprobs = nullptr, float* entropy = nullptr);

}  // namespace logprob
