// One worker's share of full-vocabulary distillation over a batch of rows
// (issue 48): vocabulary-parallel over a slice of the student's and the
// teacher's heads, stateless (the logits are recomputed, nothing of size
// [N, V] leaves a worker). Rounds of rows, each:
//   1. both models' logits on the slice and each row's first-round
//      partial (SliceDistillation::Partials); one all-gather; combined in
//      rank order in float64: lse_s, lse_t, the student's entropy, the
//      soft-target cross entropy, the forward and the reverse KL;
//   2. the JSD only (0 < beta < 1): each row's second-round partial, one
//      more all-gather, summed in rank order: the JSD and KL(p_s || m);
//   3. a backward only: the student's dL/dy on the slice, its share of
//      dL/dh (the caller sums the workers' shares in rank order) and its
//      dL/dW, dL/db, with no further collective.
// So one collective per round for the KLs and the cross entropy, two for
// the JSD (it needs both log-normalisers inside its sums). Math:
// worker/kernels/divergence.h.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"
#include "worker/scoring/slice_distillation.h"

namespace logprob {

/// A distillation's rows, [rows] each unless said otherwise, in row order;
/// the same on every worker of the group.
struct DivergencePassRows {
  DType student_dtype = v1::F32;
  const void* student_hidden = nullptr;  // [rows, H_s]
  DType teacher_dtype = v1::F32;
  const void* teacher_hidden = nullptr;  // [rows, H_t]
  int64_t rows = 0;
  double beta = 0.0;  // [0, 1]: 0 forward KL(teacher || student), 1 reverse KL, else the generalized JSD
  float temperature = 1.0f;
  const float* grad_divergence = nullptr;     // dL/dD; null: 0
  const float* grad_cross_entropy = nullptr;  // dL/dCE; null: 0
  bool backward = false;                      // step 3 (the gradients) too
  int64_t round_rows = 128;                   // rows per round (--hidden-chunk-tokens)
};

/// Per-row outputs, [rows] each; null: not wanted.
struct DivergencePassOutputs {
  float* divergence = nullptr;     // the beta's divergence (TRL's definition)
  float* cross_entropy = nullptr;  // H(p_teacher, p_student), the seeds' soft-target cross entropy
  float* entropy = nullptr;        // the student's entropy
};

/// Runs this worker's share of `in` on `slice` with `comm` the group of
/// every slice. Writes the outputs (the same on every worker) and, with
/// in.backward, its share of the student's dL/dh to grad_hidden
/// [rows, H_s] (f32) and, when non-null, adds the student's dL/dW to
/// grad_weight [slice rows, H_s] and dL/db to grad_bias [slice rows] by the
/// time slice.Flush returns (the caller flushes once per item). A row's
/// outputs and share are bitwise the same whatever else is in the batch
/// (given the worker count). INVALID_ARGUMENT for bad arguments (beta
/// outside [0, 1], a temperature <= 0); the communicator's or the GEMMs'
/// errors otherwise.
absl::Status RunDivergencePass(const DivergencePassRows& in, SliceDistillation& slice, Communicator& comm,
                               const DivergencePassOutputs& out, float* grad_hidden, float* grad_weight,
                               float* grad_bias);

}  // namespace logprob
