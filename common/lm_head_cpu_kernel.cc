#include "common/lm_head_cpu_kernel.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace logprob {

absl::StatusOr<LmHeadCpuKernel> ParseLmHeadCpuKernel(std::string_view value, std::string_view flag) {
  for (LmHeadCpuKernel k : {LmHeadCpuKernel::kAuto, LmHeadCpuKernel::kBf16, LmHeadCpuKernel::kWiden})
    if (value == LmHeadCpuKernelName(k)) return k;
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(flag), " '", std::string(value), "': must be auto, bf16 or widen"));
}

const char* LmHeadCpuKernelName(LmHeadCpuKernel k) {
  switch (k) {
    case LmHeadCpuKernel::kBf16:
      return "bf16";
    case LmHeadCpuKernel::kWiden:
      return "widen";
    default:
      return "auto";
  }
}

}  // namespace logprob
