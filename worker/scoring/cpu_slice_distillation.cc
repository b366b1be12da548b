#include "worker/scoring/cpu_slice_distillation.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/lm_head_transform_simd.h"

namespace logprob {

absl::StatusOr<std::unique_ptr<CpuSliceDistillation>> CpuSliceDistillation::Create(
    std::unique_ptr<kernels::HeadSliceBackward> student, const TeacherSlice& teacher) {
  if (student == nullptr || teacher.gemm == nullptr)
    return absl::InvalidArgumentError("distillation slice: no student or no teacher");
  if (teacher.gemm->rows() != student->gemm().rows())
    return absl::InvalidArgumentError(absl::StrCat("distillation slice: the teacher's slice has ", teacher.gemm->rows(),
                                                   " vocabulary rows, the student's ", student->gemm().rows()));
  if (teacher.transform.has_bias && teacher.bias == nullptr)
    return absl::InvalidArgumentError("distillation slice: the teacher has a bias and none was given");
  return std::unique_ptr<CpuSliceDistillation>(new CpuSliceDistillation(std::move(student), teacher));
}

absl::Status CpuSliceDistillation::Partials(const DistillationRound& round, float temperature,
                                            kernels::DivergencePartial* out) {
  ready_ = false;
  const int64_t m = round.m, V = rows();
  if (m < 0 || (m > 0 && (round.student_hidden == nullptr || round.teacher_hidden == nullptr || out == nullptr)))
    return absl::InvalidArgumentError(absl::StrCat("distillation partials: ", m, " rows, or null buffers"));
  zs_.resize(static_cast<size_t>(m * V));
  zt_.resize(static_cast<size_t>(m * V));
  if (m > 0) {
    LOGPROB_RETURN_IF_ERROR(student_->gemm().Compute(round.student_dtype, round.student_hidden, m, zs_.data()));
    kernels::ApplyLmHeadTransformSimd(student_->transform(), student_->bias(), m, V, zs_.data());
    LOGPROB_RETURN_IF_ERROR(teacher_.gemm->Compute(round.teacher_dtype, round.teacher_hidden, m, zt_.data()));
    kernels::ApplyLmHeadTransformSimd(teacher_.transform, teacher_.bias, m, V, zt_.data());
  }
  kernels::SliceDivergencePartials(zs_.data(), zt_.data(), m, V, temperature, out);
  round_ = round;
  ready_ = true;
  return absl::OkStatus();
}

absl::Status CpuSliceDistillation::JsdPartials(float temperature, double beta, const double* lse_s, const double* lse_t,
                                               kernels::JsdPartial* out) {
  if (!ready_) return absl::FailedPreconditionError("JSD partials without the round's logits");
  const int64_t V = rows();
  kernels::SliceJsdPartials(zs_.data(), zt_.data(), round_.m, V, temperature, beta, lse_s, lse_t, out);
  return absl::OkStatus();
}

absl::Status CpuSliceDistillation::Gradients(float temperature, double beta, const kernels::DivergenceGradRow* rows,
                                             float* grad_hidden, float* grad_weight, float* grad_bias) {
  if (!ready_) return absl::FailedPreconditionError("distillation gradients without the round's logits");
  ready_ = false;  // the student's logits become dL/dy
  const int64_t V = this->rows();
  kernels::DivergenceLogitGradientsRows(student_->transform(), temperature, beta, rows, zt_.data(), round_.m, V,
                                        zs_.data());
  return student_->RunOnLogitGradients(round_.student_dtype, round_.student_hidden, round_.m, zs_.data(), grad_hidden,
                                       grad_weight, grad_bias);
}

}  // namespace logprob
