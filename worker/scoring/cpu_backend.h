// The CPU backend: the SIMD row kernels (worker/kernels/row_stats,
// sampling_filter) and the oneDNN lm_head GEMM behind ScoringBackend.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// An lm_head slice for the CPU backend: the oneDNN GEMM holding it, and
/// the head's transform (applied to the GEMM's output by HiddenLogits).
class CpuLmHead final : public LmHeadWeights {
 public:
  explicit CpuLmHead(std::unique_ptr<kernels::LmHeadGemm> gemm, LmHeadTransform transform = {},
                     std::vector<float> bias = {})
      : LmHeadWeights(gemm->rows(), gemm->hidden_size(), transform, std::move(bias)), gemm_(std::move(gemm)) {}
  size_t bytes() const override { return gemm_->weight_bytes() + bias().size() * sizeof(float); }
  kernels::LmHeadGemm& gemm() const { return *gemm_; }
  std::string Describe() const override;

 private:
  std::unique_ptr<kernels::LmHeadGemm> gemm_;
};

/// CPU implementation of ScoringBackend. Row work is thread-safe (scratch
/// per call); an lm_head's GEMM is used by one call at a time (the worker
/// runs hidden-states items under its collective lock).
class CpuBackend final : public ScoringBackend {
 public:
  /// `threads`: GEMM threads of the lm_heads it loads (0: library default);
  /// `kernel`: the bf16 precision's GEMM kernel (the pool's choice,
  /// JoinReply.lm_head_cpu_kernel; kAuto: bf16 dot products where oneDNN
  /// has them). A kernel this CPU lacks fails each LoadLmHead.
  explicit CpuBackend(int threads = 0, LmHeadCpuKernel kernel = LmHeadCpuKernel::kAuto)
      : threads_(threads), kernel_(kernel) {}

  std::string name() const override { return "cpu"; }
  absl::Status SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                             uint32_t* records) override;
  absl::Status FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                   const SamplingFilter& filter, uint32_t* records) override;
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice slice,
                                                                  LmHeadPrecision precision) override;
  absl::Status HiddenPartials(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t vocab_begin,
                              const BlockRows& rows, const kernels::StatsSpec& spec, uint32_t* records) override;
  absl::Status HiddenLogits(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t M,
                            float* logits) override;
  absl::StatusOr<std::unique_ptr<SliceDistillation>> HeadDistillation(const LmHeadWeights& student,
                                                                      const LmHeadWeights& teacher, int64_t vocab_begin,
                                                                      float temperature) override;
  absl::StatusOr<std::unique_ptr<SliceBackward>> HeadBackward(const LmHeadWeights& lm_head, int64_t vocab_begin,
                                                              float temperature) override;

 private:
  const int threads_;
  const LmHeadCpuKernel kernel_;
  // HiddenPartials' round of logits ([rows, slice] f32), kept for the next
  // round: a fresh buffer per round (tens of MB, over glibc's mmap
  // threshold) paid a page fault per 4 KiB page and a memset every round.
  // Grows to the largest round (about --hidden-chunk-tokens x V floats, the
  // one round of logits docs/serving.md counts in a worker's memory) and
  // is held until the backend goes; the lock serializes rounds, which the
  // worker's collective lock already does.
  absl::Mutex round_mu_;
  std::unique_ptr<float[]> round_logits_ ABSL_GUARDED_BY(round_mu_);
  size_t round_capacity_ ABSL_GUARDED_BY(round_mu_) = 0;
};

}  // namespace logprob
