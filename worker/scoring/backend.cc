#include "worker/scoring/backend.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace logprob {

absl::Status CheckLmHeadTransform(const LmHeadSlice& slice) {
  const LmHeadTransform& t = slice.transform;
  LOGPROB_RETURN_IF_ERROR(
      CheckLmHeadScalars(t.logit_scale, t.softcap, "lm_head logit_scale", "lm_head final_logit_softcapping"));
  const size_t want = t.has_bias ? static_cast<size_t>(slice.rows) : 0;
  if (slice.bias.size() != want)
    return absl::InvalidArgumentError(absl::StrCat("lm_head bias: ", slice.bias.size(), " elements for a slice of ",
                                                   slice.rows, " rows ", t.has_bias ? "with" : "without", " a bias"));
  for (size_t i = 0; i < slice.bias.size(); ++i)
    if (!std::isfinite(slice.bias[i]))
      return absl::InvalidArgumentError(absl::StrCat("lm_head bias element ", i, " of the slice is not finite"));
  return absl::OkStatus();
}

absl::Status ScoringBackend::HiddenItemPartials(const LmHeadWeights&, const HiddenItemRows&, Communicator&,
                                                const kernels::StatsSpec&, uint32_t*) {
  return absl::UnimplementedError(
      absl::StrCat("work item: the ", name(), " backend scores hidden states in rounds, not in one pass"));
}

absl::StatusOr<std::unique_ptr<SliceBackward>> ScoringBackend::HeadBackward(const LmHeadWeights&, int64_t, float) {
  return absl::FailedPreconditionError(
      absl::StrCat("this pool's backend (", name(), ") has no lm_head backward (docs/gradients.md)"));
}

absl::StatusOr<std::unique_ptr<SliceDistillation>> ScoringBackend::HeadDistillation(const LmHeadWeights&,
                                                                                    const LmHeadWeights&, int64_t,
                                                                                    float) {
  return absl::FailedPreconditionError(
      absl::StrCat("this pool's backend (", name(), ") has no distillation yet (docs/distillation.md)"));
}

absl::StatusOr<DevicePayload> ScoringBackend::OpenCudaIpcPayload(std::string_view, int64_t, int64_t, int64_t) {
  return absl::FailedPreconditionError(
      absl::StrCat("CUDA IPC input: this worker's backend (", name(), ") has no GPU to map it into"));
}

absl::StatusOr<std::unique_ptr<DeviceCopy>> ScoringBackend::NewDeviceCopy() {
  return absl::FailedPreconditionError(absl::StrCat("this worker's backend (", name(), ") has no device memory"));
}

}  // namespace logprob
