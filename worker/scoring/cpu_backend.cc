#include "worker/scoring/cpu_backend.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/lm_head_transform_simd.h"
#include "worker/kernels/sampling_filter.h"
#include "worker/scoring/cpu_slice_backward.h"
#include "worker/scoring/cpu_slice_distillation.h"
#include "worker/scoring/host_partials.h"

namespace logprob {

absl::Status CpuBackend::SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                       uint32_t* records) {
  HostSlicePartials(block, rows, spec, records);
  return absl::OkStatus();
}

absl::Status CpuBackend::FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows,
                                             const kernels::StatsSpec& spec, const SamplingFilter& filter,
                                             uint32_t* records) {
  std::vector<float> scratch(kernels::kPartialScratchFloats), row_f32(static_cast<size_t>(block.len)), filter_scratch;
  const size_t words = kernels::PartialWords(spec);
  for (int64_t i = 0; i < rows.count; ++i) {
    kernels::SliceRow r = HostSliceRow(block, rows, spec, i);
    ToFloat(block.dtype, r.logits, static_cast<size_t>(block.len), row_f32.data());
    for (auto& x : row_f32) x = x / spec.temperature;
    r.keep_min = kernels::SamplingKeepMin(row_f32.data(), block.len, filter.top_k, filter.top_p, &filter_scratch);
    kernels::ComputePartial(block.dtype, r, block.vocab_begin, block.len, spec, records + i * words, scratch.data());
  }
  return absl::OkStatus();
}

std::string CpuLmHead::Describe() const {
  const kernels::LmHeadGemm& g = *gemm_;
  const bool converted = !kernels::IsGemmOperand(g.weight_dtype(), g.compute_dtype(), g.precision());
  return absl::StrCat("oneDNN ", g.compute_dtype() == v1::BF16 ? "bf16" : "f32", " GEMM, ",
                      LmHeadPrecisionName(g.precision()), " operands, ", DTypeName(g.weight_dtype()), " weights",
                      converted ? " converted per tile" : " used in place");
}

absl::StatusOr<std::shared_ptr<const LmHeadWeights>> CpuBackend::LoadLmHead(LmHeadSlice slice,
                                                                            LmHeadPrecision precision) {
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadTransform(slice));
  LOGPROB_ASSIGN_OR_RETURN(auto gemm, kernels::LmHeadGemm::Create(slice.dtype, std::move(slice.weight), slice.rows,
                                                                  slice.hidden_size, threads_, precision, kernel_));
  return std::shared_ptr<const LmHeadWeights>(
      std::make_shared<CpuLmHead>(std::move(gemm), slice.transform, std::move(slice.bias)));
}

absl::Status CpuBackend::HiddenPartials(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden,
                                        int64_t vocab_begin, const BlockRows& rows, const kernels::StatsSpec& spec,
                                        uint32_t* records) {
  const size_t need = static_cast<size_t>(rows.count * lm_head.rows());
  absl::MutexLock lock(&round_mu_);
  if (need > round_capacity_) {  // uninitialized: the GEMM writes every element
    round_logits_ = std::unique_ptr<float[]>(new float[need]);
    round_capacity_ = need;
  }
  float* logits = round_logits_.get();
  LOGPROB_RETURN_IF_ERROR(HiddenLogits(lm_head, hidden_dtype, hidden, rows.count, logits));
  return SlicePartials(LogitsBlock{v1::F32, logits, vocab_begin, lm_head.rows()}, rows, spec, records);
}

absl::Status CpuBackend::HiddenLogits(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t M,
                                      float* logits) {
  LOGPROB_RETURN_IF_ERROR(static_cast<const CpuLmHead&>(lm_head).gemm().Compute(hidden_dtype, hidden, M, logits));
  // The head's bias, multiplier and softcap: element-wise on the f32 GEMM
  // output, so a row's logits stay independent of the batch.
  kernels::ApplyLmHeadTransformSimd(lm_head.transform(), lm_head.transform().has_bias ? lm_head.bias().data() : nullptr,
                                    M, lm_head.rows(), logits);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SliceBackward>> CpuBackend::HeadBackward(const LmHeadWeights& lm_head,
                                                                        int64_t vocab_begin, float temperature) {
  const auto& head = static_cast<const CpuLmHead&>(lm_head);
  LOGPROB_ASSIGN_OR_RETURN(auto backward,
                           kernels::HeadSliceBackward::Create(&head.gemm(), vocab_begin,
                                                              head.transform().has_bias ? head.bias().data() : nullptr,
                                                              head.transform(), temperature));
  return std::make_unique<CpuSliceBackward>(std::move(backward));
}

absl::StatusOr<std::unique_ptr<SliceDistillation>> CpuBackend::HeadDistillation(const LmHeadWeights& student,
                                                                                const LmHeadWeights& teacher,
                                                                                int64_t vocab_begin,
                                                                                float temperature) {
  const auto& s = static_cast<const CpuLmHead&>(student);
  const auto& t = static_cast<const CpuLmHead&>(teacher);
  LOGPROB_ASSIGN_OR_RETURN(
      auto backward,
      kernels::HeadSliceBackward::Create(&s.gemm(), vocab_begin, s.transform().has_bias ? s.bias().data() : nullptr,
                                         s.transform(), temperature));
  TeacherSlice teacher_slice{&t.gemm(), t.transform(), t.transform().has_bias ? t.bias().data() : nullptr};
  LOGPROB_ASSIGN_OR_RETURN(auto slice, CpuSliceDistillation::Create(std::move(backward), teacher_slice));
  return std::unique_ptr<SliceDistillation>(std::move(slice));
}

}  // namespace logprob
