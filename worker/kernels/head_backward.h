// The lm_head's backward over one worker's vocabulary slice (issue 47):
// from a forward's per-row statistics and the upstream gradients of the
// token logprobs and entropies, the gradient of the slice's logits, then
// the slice's share of dL/dh and its dL/dW and dL/db. Nothing of size
// [N, V] is kept: the logits are recomputed a chunk of rows at a time with
// the forward's own GEMM (LmHeadGemm), so the backward's probabilities are
// the forward's bits.
//
// Math (NeMo-RL DistributedLogprob.backward and TRL 1.16's
// ChunkedLogProbFunction.backward, with the entropy term of
// ChunkedDistributedEntropy): for one row with GEMM output y = h W^T,
// z = softcap(scale * (y + b)) (common/lm_head_transform.h), x = z / T,
// lse = logsumexp_v x_v, p = exp(x - lse), logprob = x_t - lse and
// entropy H = lse - sum_v p_v x_v,
//
//   dL/dx_v = g_lp (1[v = t] - p_v) - g_ent p_v (x_v - lse + H)
//   dL/dy_v = dL/dx_v / T * scale * (1 - (z_v / c)^2)   (the last factor
//             only with a softcap c; dL/db_v is the same value)
//   dL/dh   = sum over slices of  dL/dy[:, slice] W[slice]      [N, H]
//   dL/dW   = dL/dy^T h                                       [V, H]
//   dL/db   = sum_n dL/dy[n]                                  [V]
//
// lse and H are the whole vocabulary's (the forward's outputs, which the
// client sends back: the backward is stateless, no collective is needed
// before the gradients), so each slice computes its share alone; the
// caller sums the slices' dL/dh in rank order.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/lm_head_transform.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::kernels {

/// The per-row inputs of a backward, [M] each, in row order.
struct BackwardRows {
  const int64_t* targets = nullptr;      // global ids; < 0: no logprob term (ignored rows)
  const float* lse = nullptr;            // the forward's logsumexp of x = z / T over the whole vocabulary
  const float* entropy = nullptr;        // the forward's entropy (needed when grad_entropy is given)
  const float* grad_logprobs = nullptr;  // dL/dlogprob; null: 0
  const float* grad_entropy = nullptr;   // dL/dentropy; null: 0
};

/// In place over `logits` [M, C] (f32, row-major): the transformed logits
/// z of vocabulary columns [vocab_begin, vocab_begin + C) of rows [M]
/// become dL/dy, the gradient of the GEMM output (header comment), in
/// float64 per element, rounded once. `scale` / `softcap` from `t`;
/// `temperature` > 0. Each element depends only on its own logit and its
/// row's inputs (batch invariance). Thread-safe on distinct buffers.
void LogitGradients(const LmHeadTransform& t, float temperature, const BackwardRows& rows, int64_t M,
                    int64_t vocab_begin, int64_t C, float* logits);

/// A slice's backward: dL/dh's share of the slice and dL/dW, dL/db of its
/// rows, from hidden states, with the slice's forward GEMM recomputing the
/// logits. Not thread-safe: one Run at a time (oneDNN on OpenMP inside).
class HeadSliceBackward {
 public:
  /// `gemm`: the slice's forward GEMM (its weights, precision and
  /// threads: the backward recomputes exactly the forward's logits);
  /// `vocab_begin`: the slice's first global id; `bias`: the slice's
  /// bias [gemm.rows()] (f32) or null (t.has_bias false). The gradients
  /// are float32: dL/dh accumulates over the slice's columns in a fixed
  /// order, dL/dW and dL/db over the rows in row order. INTERNAL when
  /// oneDNN cannot make its matmuls.
  static absl::StatusOr<std::unique_ptr<HeadSliceBackward>> Create(LmHeadGemm* gemm, int64_t vocab_begin,
                                                                   const float* bias, const LmHeadTransform& t,
                                                                   float temperature);
  ~HeadSliceBackward();

  LmHeadGemm& gemm() const;                  // the slice's forward GEMM
  const LmHeadTransform& transform() const;  // its transform
  const float* bias() const;                 // its bias [gemm().rows()], or null
  int64_t vocab_begin() const;               // its first global id
  float temperature() const;

  /// For rows hidden[M, H] (`hidden_dtype` F32, BF16 or F16, as the
  /// forward took them) with `rows`: writes the slice's share of dL/dh to
  /// grad_hidden [M, H] (f32) and, when non-null, adds dL/dW of the slice
  /// to grad_weight [rows(), H] (f32) and dL/db to grad_bias [rows()]
  /// (accumulation over calls: micro-batches of one step). A row's
  /// grad_hidden is bitwise the same whatever M and its position.
  /// The rows are taken in chunks of 256 (whole tiles of 64 rows); for
  /// each chunk one OpenMP team (omp_get_max_threads()) shares the
  /// slice's column tiles, converting each tile's weights to operands once
  /// and multiplying it with every row tile of the chunk. Memory, bounded
  /// whatever M: kept between calls, a chunk's logits (min(M, 256) x
  /// rows() f32) and, with grad_weight, its hidden rows as operands (up to
  /// 256 x H f32); during a call, a dL/dh sum of 256 x H f32 for each
  /// thread but the first and each thread's tile buffers (192 x H f32,
  /// 128 x H more with grad_weight, and the matmuls' scratchpads).
  /// INVALID_ARGUMENT for M < 0 or null buffers; INTERNAL if oneDNN fails.
  absl::Status Run(DType hidden_dtype, const void* hidden, int64_t M, const BackwardRows& rows, float* grad_hidden,
                   float* grad_weight, float* grad_bias);

  /// Run for rows whose transformed logits the caller has already
  /// computed with the slice's GEMM and transform: `logits` [M, rows()]
  /// (f32, row-major; overwritten with dL/dy). The same results as Run,
  /// without recomputing the logits (the backward pass computes them once
  /// for its partial records and its gradients). Memory: as Run's, less
  /// the logits.
  absl::Status RunOnLogits(DType hidden_dtype, const void* hidden, int64_t M, const BackwardRows& rows, float* logits,
                           float* grad_hidden, float* grad_weight, float* grad_bias);

  /// RunOnLogits for rows whose dL/dy the caller has computed (another
  /// loss of the same logits: the distillation divergences of
  /// worker/kernels/divergence.h): `logit_grads` [M, rows()] (f32,
  /// row-major; read only, though not const for the tiles' sake). The same
  /// GEMMs, order and memory.
  absl::Status RunOnLogitGradients(DType hidden_dtype, const void* hidden, int64_t M, float* logit_grads,
                                   float* grad_hidden, float* grad_weight, float* grad_bias);

 private:
  struct Impl;
  explicit HeadSliceBackward(std::unique_ptr<Impl> impl);
  absl::Status CheckRun(DType hidden_dtype, const void* hidden, int64_t M, const BackwardRows& rows,
                        const float* grad_hidden) const;
  /// The gradients of rows [r0, r0 + m) (m <= a chunk's rows) from their
  /// transformed logits `z` [m, rows()] (overwritten with dL/dy): the
  /// column tiles the outer loop, in one OpenMP parallel region.
  /// `rows_or_null` null: `z` already holds dL/dy.
  absl::Status Chunk(DType hidden_dtype, const void* hidden, int64_t r0, int64_t m, const BackwardRows* rows_or_null,
                     float* z, float* grad_hidden, float* grad_weight, float* grad_bias);
  std::unique_ptr<Impl> impl_;
};

}  // namespace logprob::kernels
