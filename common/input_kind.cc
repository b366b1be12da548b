#include "common/input_kind.h"

namespace logprob {

const InputKindRules& RulesOf(InputKind kind) {
  // name, readable_here, batchable, every_input_row, sampling_filters, hidden_states_only, needs_one_pass, unavailable
  static const InputKindRules kBytes{"bytes", true, true, false, true, false, false, v1::ERROR_REASON_UNSPECIFIED};
  static const InputKindRules kShm{
      "shared memory", true, true, false, true, false, false, v1::SHARED_MEMORY_UNAVAILABLE};
  static const InputKindRules kIpc{"CUDA IPC", false, false, true, false, true, true, v1::CUDA_IPC_UNAVAILABLE};
  static const InputKindRules kFile{"file", true, false, false, true, false, false, v1::ERROR_REASON_UNSPECIFIED};
  switch (kind) {
    case InputKind::kFile:
      return kFile;
    case InputKind::kSharedMemory:
      return kShm;
    case InputKind::kCudaIpc:
      return kIpc;
    case InputKind::kBytes:
      break;
  }
  return kBytes;
}

InputKind KindOf(const v1::Tensor& tensor) {
  switch (tensor.source_case()) {
    case v1::Tensor::kSharedMemory:
      return InputKind::kSharedMemory;
    case v1::Tensor::kCudaIpc:
      return InputKind::kCudaIpc;
    default:
      return InputKind::kBytes;
  }
}

bool HasSamplingFilters(const v1::ScoreOptions& options) {
  return options.sampling_top_k() > 0 || (options.has_sampling_top_p() && options.sampling_top_p() < 1.0f);
}

bool CanScoreInOnePass(int workers, bool device_collectives) { return workers == 1 || device_collectives; }

}  // namespace logprob
