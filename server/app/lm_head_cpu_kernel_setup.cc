#include "server/app/lm_head_cpu_kernel_setup.h"

#include <algorithm>
#include <cstdint>

#include "common/log_line.h"
#include "common/status_macros.h"
#include "worker/kernels/lm_head_kernel_choice.h"

namespace logprob {

absl::StatusOr<std::string> ResolveLmHeadCpuKernel(const ServerFlags& flags, const LmHeads& heads, int threads) {
  if (flags.backend != "cpu") return std::string();
  int64_t hidden_size = 0;
  for (const v1::LmHeadInfo& h : heads.List()) hidden_size = std::max(hidden_size, h.hidden_size());
  LOGPROB_ASSIGN_OR_RETURN(const kernels::LmHeadKernelChoice choice,
                           kernels::ChooseLmHeadCpuKernel(flags.lm_head_cpu_kernel, hidden_size, threads));
  LogLine() << "logprob-server: lm_head CPU kernel " << LmHeadCpuKernelName(choice.kernel) << " (" << choice.why << ")";
  return std::string(LmHeadCpuKernelName(choice.kernel));
}

}  // namespace logprob
