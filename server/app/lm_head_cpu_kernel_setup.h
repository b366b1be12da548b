// --lm-head-cpu-kernel at start-up: the front-end resolves it once for the
// whole CPU pool (worker/kernels/lm_head_kernel_choice.h) and sends the
// result in JoinReply.lm_head_cpu_kernel, so every worker, and every later
// generation of the pool, runs the same bf16 GEMM kernel (issue 45).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/app/server_flags.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// The kernel name for JoinReply and ServerInfo: "" for a cuda pool (its
/// GEMM is cuBLASLt's); else "bf16" or "widen", kAuto resolved on this CPU
/// (the front-end's; local workers share it, external workers should run
/// on the same CPU model) for the widest startup head's hidden size (none:
/// no measurement), with `threads` GEMM threads per worker. Logs the choice
/// and why. FAILED_PRECONDITION when --lm-head-cpu-kernel bf16 names a
/// kernel this CPU lacks. Call once, at start-up, before the pool.
absl::StatusOr<std::string> ResolveLmHeadCpuKernel(const ServerFlags& flags, const LmHeads& heads, int threads);

}  // namespace logprob
