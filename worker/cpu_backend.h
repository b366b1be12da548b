// The CPU backend: the SIMD row kernels (worker/kernels/row_stats,
// sampling_filter) and the oneDNN lm_head GEMM behind ScoringBackend.
#pragma once

#include <memory>

#include "worker/backend.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob {

/// CPU implementation of ScoringBackend. Row work is thread-safe (scratch
/// per call); the lm_head GEMM is used by one call at a time (the worker
/// runs hidden-states items under its collective lock).
class CpuBackend final : public ScoringBackend {
 public:
  /// `lm_head` may be null (no hidden-states scoring).
  explicit CpuBackend(std::unique_ptr<kernels::LmHeadGemm> lm_head = nullptr) : lm_head_(std::move(lm_head)) {}

  std::string name() const override { return "cpu"; }
  absl::Status SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                             uint32_t* records) override;
  absl::Status FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                   const SamplingFilter& filter, uint32_t* records) override;
  bool has_lm_head() const override { return lm_head_ != nullptr; }
  int64_t lm_head_rows() const override { return lm_head_ ? lm_head_->rows() : 0; }
  int64_t lm_head_hidden_size() const override { return lm_head_ ? lm_head_->hidden_size() : 0; }
  absl::Status HiddenPartials(DType hidden_dtype, const void* hidden, int64_t vocab_begin, const BlockRows& rows,
                              const kernels::StatsSpec& spec, uint32_t* records) override;
  absl::Status HiddenLogits(DType hidden_dtype, const void* hidden, int64_t M, float* logits) override;

 private:
  std::unique_ptr<kernels::LmHeadGemm> lm_head_;
};

}  // namespace logprob
