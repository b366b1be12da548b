// The CPU's SliceDistillation (slice_distillation.h): each head's oneDNN
// GEMM and transform give a round's logits (host f32, kept), the kernels
// of worker/kernels/divergence.h their partials and the student's dL/dy,
// and the student's kernels::HeadSliceBackward turns dL/dy into its share
// of dL/dh and dL/dW, dL/db, added to the caller's sums round by round.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/lm_head_transform.h"
#include "worker/kernels/head_backward.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scoring/slice_distillation.h"

namespace logprob {

/// The teacher's slice: its GEMM (not owned), transform and bias.
struct TeacherSlice {
  kernels::LmHeadGemm* gemm = nullptr;
  LmHeadTransform transform;
  const float* bias = nullptr;  // [gemm->rows()] when transform.has_bias
};

/// SliceDistillation over the student's kernels::HeadSliceBackward (its
/// GEMM, bias, transform) and the teacher's slice, of the same rows.
/// Memory: both models' round logits (2 x m x rows() f32) plus the
/// backward's. Not thread-safe.
class CpuSliceDistillation final : public SliceDistillation {
 public:
  /// INVALID_ARGUMENT when the slices' rows differ or the teacher has none.
  static absl::StatusOr<std::unique_ptr<CpuSliceDistillation>> Create(
      std::unique_ptr<kernels::HeadSliceBackward> student, const TeacherSlice& teacher);
  int64_t rows() const override { return student_->gemm().rows(); }
  int64_t student_hidden_size() const override { return student_->gemm().hidden_size(); }
  int64_t teacher_hidden_size() const override { return teacher_.gemm->hidden_size(); }
  absl::Status Partials(const DistillationRound& round, float temperature, kernels::DivergencePartial* out) override;
  absl::Status JsdPartials(float temperature, double beta, const double* lse_s, const double* lse_t,
                           kernels::JsdPartial* out) override;
  absl::Status Gradients(float temperature, double beta, const kernels::DivergenceGradRow* rows, float* grad_hidden,
                         float* grad_weight, float* grad_bias) override;
  absl::Status Flush(float*, float*) override { return absl::OkStatus(); }

 private:
  CpuSliceDistillation(std::unique_ptr<kernels::HeadSliceBackward> student, const TeacherSlice& teacher)
      : student_(std::move(student)), teacher_(teacher) {}
  std::unique_ptr<kernels::HeadSliceBackward> student_;
  TeacherSlice teacher_;
  std::vector<float> zs_, zt_;  // the round's transformed logits [m, rows()]
  DistillationRound round_;
  bool ready_ = false;  // a Partials before the other steps
};

}  // namespace logprob
