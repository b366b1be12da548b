#include "worker/scoring/cpu_slice_backward.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/lm_head_transform_simd.h"

namespace logprob {

absl::Status CpuSliceBackward::Records(DType hidden_dtype, const void* hidden, int64_t m, const int64_t* targets,
                                       const kernels::StatsSpec& spec, uint32_t* records) {
  m_ = -1;
  LOGPROB_RETURN_IF_ERROR(CheckRecordsCall(hidden_dtype, hidden, m, spec, records));
  kernels::LmHeadGemm& gemm = backward_->gemm();
  const int64_t V = gemm.rows();
  logits_.resize(static_cast<size_t>(m * V));
  LOGPROB_RETURN_IF_ERROR(gemm.Compute(hidden_dtype, hidden, m, logits_.data()));
  kernels::ApplyLmHeadTransformSimd(backward_->transform(), backward_->bias(), m, V, logits_.data());
  const size_t words = kernels::PartialWords(spec);
  scratch_.resize(kernels::kPartialScratchFloats);
  for (int64_t i = 0; i < m; ++i) {
    kernels::SliceRow row;
    row.logits = logits_.data() + i * V;
    row.target = targets != nullptr ? targets[i] : -1;
    kernels::ComputePartial(v1::F32, row, backward_->vocab_begin(), V, spec, records + i * words, scratch_.data());
  }
  hidden_dtype_ = hidden_dtype;
  hidden_ = hidden;
  m_ = m;
  return absl::OkStatus();
}

absl::Status CpuSliceBackward::Gradients(const kernels::BackwardRows& rows, float* grad_hidden, float* grad_weight,
                                         float* grad_bias) {
  if (m_ < 0) return absl::FailedPreconditionError("backward gradients without the round's records");
  const int64_t m = m_;
  m_ = -1;  // the logits become dL/dy
  return backward_->RunOnLogits(hidden_dtype_, hidden_, m, rows, logits_.data(), grad_hidden, grad_weight, grad_bias);
}

}  // namespace logprob
