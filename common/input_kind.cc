#include "common/input_kind.h"

namespace logprob {

const InputKindRules& RulesOf(InputKind kind) {
  //                                name            readable batchable every_row filters hidden_only one_pass
  static const InputKindRules kBytes{"bytes", true, true, false, true, false, false};
  static const InputKindRules kShm{"shared memory", true, true, false, true, false, false};
  static const InputKindRules kIpc{"CUDA IPC", false, false, true, false, true, true};
  switch (kind) {
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
