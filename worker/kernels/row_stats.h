// Per-row scoring statistics over a vocabulary slice, and their exact
// combination across slices (vocab-parallel).
//
// One pass over a row slice (online softmax, block by block) yields a
// packed "partial" (layout: worker/kernels/partial_record.h): running max m, s = sum exp(x - m),
// u = sum exp(x - m) * (x - m) (relative to m, so entropy
// H = log s - u / s has no cancellation against m), the target's x, the x at requested gather ids and
// the slice's top-K candidates. Partials of all slices of a row combine
// exactly (m = max m_i, s = sum s_i exp(m_i - m), ...), so vocab-parallel
// workers need one collective round per chunk instead of the three
// all-reduces of NeMo-RL `DistributedLogprob` / Megatron
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
  float temperature = 1.0f;  // > 0
  bool entropy = false;      // entropy output wanted
  int topk = 0;              // K of topk_logprobs / topk_indices
  int gather_k = 0;          // ids per row for gathered_logprobs
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
};

/// Combines the records of one row from `count` slices, in the given
/// (rank) order, in float64, and writes the row's outputs:
/// token_logprob = x_t - logZ (0 when !has_target, -inf when the target was
/// filtered out), entropy = log S - U/S >= 0, the top-K of log_softmax
/// (largest first, equal values by lower id), gathered = x_g - logZ.
void CombinePartials(const uint32_t* const* records, int count, const StatsSpec& spec, bool has_target,
                     const RowOutput& out);

}  // namespace logprob::kernels
