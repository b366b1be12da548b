#include "worker/backend.h"

#include "absl/strings/str_cat.h"

namespace logprob {

absl::Status ScoringBackend::HiddenItemPartials(const LmHeadWeights&, const HiddenItemRows&, Communicator&,
                                                const kernels::StatsSpec&, uint32_t*) {
  return absl::UnimplementedError(
      absl::StrCat("work item: the ", name(), " backend scores hidden states in rounds, not in one pass"));
}

absl::StatusOr<DevicePayload> ScoringBackend::OpenCudaIpcPayload(std::string_view, int64_t, int64_t, int64_t) {
  return absl::FailedPreconditionError(
      absl::StrCat("CUDA IPC input: this worker's backend (", name(), ") has no GPU to map it into"));
}

absl::StatusOr<std::unique_ptr<DeviceCopy>> ScoringBackend::NewDeviceCopy() {
  return absl::FailedPreconditionError(absl::StrCat("this worker's backend (", name(), ") has no device memory"));
}

}  // namespace logprob
