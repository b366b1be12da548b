// The CPU's SliceBackward (slice_backward.h): the slice's oneDNN GEMM and
// transform recompute a round's logits (host f32, kept), the CPU partial
// kernel writes their records, and kernels::HeadSliceBackward turns them
// into dL/dy, the slice's share of dL/dh and dL/dW, dL/db, which it adds
// to the caller's sums round by round (Flush has nothing left to add).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "worker/kernels/head_backward.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scoring/slice_backward.h"

namespace logprob {

/// SliceBackward over a kernels::HeadSliceBackward (its GEMM, bias,
/// transform, first id and temperature). Memory: a round's logits
/// (m x rows() f32) plus HeadSliceBackward's. Not thread-safe.
class CpuSliceBackward final : public SliceBackward {
 public:
  /// `gemm`: the GEMM `backward` uses when this owns it (tests), else null.
  explicit CpuSliceBackward(std::unique_ptr<kernels::HeadSliceBackward> backward,
                            std::unique_ptr<kernels::LmHeadGemm> gemm = nullptr)
      : gemm_(std::move(gemm)), backward_(std::move(backward)) {}
  int64_t rows() const override { return backward_->gemm().rows(); }
  int64_t hidden_size() const override { return backward_->gemm().hidden_size(); }
  int64_t vocab_begin() const override { return backward_->vocab_begin(); }
  float temperature() const override { return backward_->temperature(); }
  absl::Status Records(DType hidden_dtype, const void* hidden, int64_t m, const int64_t* targets,
                       const kernels::StatsSpec& spec, uint32_t* records) override;
  absl::Status Gradients(const kernels::BackwardRows& rows, float* grad_hidden, float* grad_weight,
                         float* grad_bias) override;
  absl::Status Flush(float*, float*) override { return absl::OkStatus(); }

 private:
  std::unique_ptr<kernels::LmHeadGemm> gemm_;  // destroyed after backward_
  std::unique_ptr<kernels::HeadSliceBackward> backward_;
  std::vector<float> logits_, scratch_;
  DType hidden_dtype_ = v1::F32;
  const void* hidden_ = nullptr;  // the last Records' rows
  int64_t m_ = -1;                // -1: no Records yet
};

}  // namespace logprob
