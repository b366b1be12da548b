// Per-row scoring statistics over a vocabulary slice, and their exact
// combination across slices (vocab-parallel).
//
// One pass over a row slice (online softmax, block by block) yields a
// packed "partial" (layout: worker/kernels/partial_record.h): running max m, s = sum exp(x - m),
// u = sum exp(x - m) * (x - m) (relative to m, so entropy
// H = log s - u / s has no cancellation against m), the target's x, the x at requested gather ids and
// the slice's top-K candidates; on request q = sum exp(2(x - m)) (log_sum_sq_probs), the sum of x
// before the sampling filters (mean_logits) and the max x before the target (is_top1; TRL
// trl/kernels/chunked_logprob.py `_forward_kernel`: sq_sum_exp, z_sum, max_before_target). Partials of all slices of a
// row combine exactly (m = max m_i, s = sum s_i exp(m_i - m), ...), so vocab-parallel workers need one collective round
// per chunk instead of the three all-reduces of NeMo-RL `DistributedLogprob` / Megatron
// `_VocabParallelCrossEntropy`.
//
// x = logits / temperature (float32). Outputs follow docs/SPEC.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "common/dtype.h"
#include "worker/kernels/partial_record.h"
#include "worker/kernels/simd.h"

namespace logprob::kernels {

/// What a job asks of every row.
struct StatsSpec {
  float temperature = 1.0f;       // > 0
  bool entropy = false;           // entropy output wanted
  bool log_sum_sq_probs = false;  // log_sum_sq_probs wanted (record field q)
  bool mean_logits = false;       // mean_logits wanted (record field zsum; needs vocab_size)
  bool is_top1 = false;           // is_top1 wanted (record field pre_target_max)
  int topk = 0;                   // K of topk_logprobs / topk_indices
  int gather_k = 0;               // ids per row for gathered_logprobs
  int64_t vocab_size = 0;         // full V of the rows (mean_logits = zsum / V)
};

/// Size, in 32-bit words, of one packed partial record for `spec`
/// (layout: worker/kernels/partial_record.h).
inline size_t PartialWords(const StatsSpec& spec) {
  return static_cast<size_t>(record::Words(spec.gather_k, spec.topk));
}

/// One row's inputs on one vocab slice [vocab_begin, vocab_begin + len).
struct SliceRow {
  const void* logits = nullptr;         // len elements of the job's dtype
  int64_t target = -1;                  // global id; < 0: no target
  const int64_t* gather_ids = nullptr;  // spec.gather_k global ids
  /// Sampling filters: entries with x < keep_min are removed (-inf).
  float keep_min = -std::numeric_limits<float>::infinity();
  /// Sampling mask (docs/SPEC.md "Sampling masks"): when not null, the
  /// `keep_count` global ids it lists (strictly ascending; ids outside this
  /// slice are skipped) are the row's support and every other entry is
  /// removed (-inf), after the mean_logits sum. Not with is_top1.
  const int32_t* keep_ids = nullptr;
  int64_t keep_count = 0;
};

/// Scratch floats ComputePartial needs: one padded SIMD block.
constexpr size_t kPartialScratchFloats = kBlockBufferFloats;

/// Computes the packed partial record (PartialWords(spec) words) of `row`
/// over its slice of `len` logits of `dtype` starting at global column
/// `vocab_begin`. `scratch` holds kPartialScratchFloats floats.
/// Deterministic: depends only on this row's values.
void ComputePartial(DType dtype, const SliceRow& row, int64_t vocab_begin, int64_t len, const StatsSpec& spec,
                    uint32_t* out, float* scratch);

/// Where CombinePartials writes one row's outputs; null pointers are
/// skipped. topk_* hold spec.topk entries, gathered spec.gather_k.
struct RowOutput {
  float* token_logprob = nullptr;
  float* entropy = nullptr;
  float* topk_logprobs = nullptr;
  int64_t* topk_indices = nullptr;
  float* gathered = nullptr;
  float* log_sum_sq_probs = nullptr;
  float* mean_logits = nullptr;
  int32_t* is_top1 = nullptr;  // 0 / 1
  /// log Z: the log-normaliser of x = z / T over the (filtered or masked)
  /// support, what a row's logprobs are x - log Z of; the head's backward
  /// (worker/kernels/head_backward.h) takes it.
  float* logsumexp = nullptr;
};

/// Combines the records of one row from `count` slices, in the given
/// (rank) order, in float64, and writes the row's outputs:
/// token_logprob = x_t - logZ (0 when !has_target, -inf when the target was
/// filtered out), entropy = log S - U/S >= 0, the top-K of log_softmax
/// (largest first, equal values by lower id), gathered = x_g - logZ.
/// With a target (has_target), on request (spec): log_sum_sq_probs =
/// log Q - 2 log S with Q = sum_r q_r exp(2(m_r - M)) (log of sum_v p_v^2
/// over the filtered distribution, <= 0); mean_logits = (sum_r zsum_r) /
/// spec.vocab_size (x before the filters); is_top1 = 1 when target_x >= M
/// and target_x > max_r pre_target_max_r (the target is the argmax of x,
/// the lowest id among equal maxima; TRL's rule), else 0. Without a target
/// (ignore_index) the three are 0. Deterministic: the same records in the
/// same order give the same bits.
void CombinePartials(const uint32_t* const* records, int count, const StatsSpec& spec, bool has_target,
                     const RowOutput& out);

}  // namespace logprob::kernels
