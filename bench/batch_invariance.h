// Batch invariance of a scoring backend (docs/SPEC.md "Numbers": results do
// not depend on how requests are batched): a fixed set of probe rows is
// embedded at several offsets inside batches of several sizes M, between
// filler rows that change from batch to batch; every probe row's packed
// record, and the outputs kernels::CombinePartials makes of it, must be
// bitwise identical in every batch. Used on the GPU by
// tests/cuda_invariance_test.cc and `logprob_cuda_bench --mode invariance`;
// works on any ScoringBackend (host inputs) and, with device inputs, on the
// CUDA backend's current device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/kernels/row_stats.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// The batches to try and what to compute for every row.
struct InvarianceOptions {
  std::vector<int64_t> batch_sizes = {1, 7, 16, 300, 1024, 4133, 8141};
  /// Where the first probe row sits; the others follow it. Pairs with
  /// offset >= M are skipped; probe rows past the batch's end are left out.
  std::vector<int64_t> offsets = {0, 1, 17, 300};
  int probe_rows = 3;
  kernels::StatsSpec spec = DefaultSpec();
  uint64_t seed = 1;

  /// Entropy, log_sum_sq_probs, mean_logits, is_top1, top-20 and 2
  /// gathered ids: every record field in use (spec.vocab_size is set by the
  /// checks).
  static kernels::StatsSpec DefaultSpec() {
    kernels::StatsSpec s;
    s.entropy = true;
    s.log_sum_sq_probs = true;
    s.mean_logits = true;
    s.is_top1 = true;
    s.topk = 20;
    s.gather_k = 2;
    return s;
  }
};

/// What a check saw. ok() when every probe row matched.
struct InvarianceResult {
  int64_t batches = 0;                        // backend calls
  int64_t comparisons = 0;                    // probe rows compared with their first occurrence
  int64_t mismatches = 0;                     // of those, rows whose record or outputs differ
  std::vector<std::string> first_mismatches;  // descriptions of the first 10
  bool ok() const { return mismatches == 0 && comparisons > 0; }
  /// One line: "N batches, C probe-row comparisons, K mismatches" and the
  /// first mismatches, one per line.
  std::string Summary() const;
};

/// Hidden-states path, one pass with W = 1 (SelfCommunicator): calls
/// backend.HiddenItemPartials on batches of M hidden-state rows [M, H] of
/// `dtype` (H = lm_head.hidden_size(), values uniform(-1, 1)) times
/// `lm_head` (loaded into `backend`), targets in [0, lm_head.rows()) (a fifth of the filler rows without one).
/// With `on_device` the rows are in cudaMalloc memory of the current CUDA
/// device (HiddenItemRows::own_on_device; needs a CUDA build), else in
/// host memory. Returns the first error of a backend or CUDA call (e.g.
/// UNIMPLEMENTED from a backend without the one-pass path).
absl::StatusOr<InvarianceResult> CheckHiddenItemInvariance(ScoringBackend& backend, const LmHeadWeights& lm_head,
                                                           DType dtype, bool on_device,
                                                           const InvarianceOptions& options);

/// Logits path: calls backend.SlicePartials on batches of M full rows of V
/// logits of `dtype` in host memory (values 8 * uniform(-1, 1)). Returns
/// the first error of a backend call.
absl::StatusOr<InvarianceResult> CheckSliceInvariance(ScoringBackend& backend, DType dtype, int64_t V,
                                                      const InvarianceOptions& options);

}  // namespace logprob
