// --lm-head-cpu-kernel: which CPU kernel computes the bf16 precision's
// lm_head GEMM (common/lm_head_precision.h kBf16: operands rounded to bf16,
// float32 accumulation). Two kernels compute exactly that math and differ
// only in summation order (so in the last bits of a logit):
//  - kBf16: oneDNN's bf16 x bf16 -> f32 matmul (AVX512-BF16 dot products,
//    or AMX tiles where the CPU has them);
//  - kWiden: the bf16 operands widened to f32 (exact) and oneDNN's f32
//    matmul: faster than bf16 dot products on CPUs without AMX, where the
//    f32 FMA units are the box's best GEMM (issue 45, docs/benchmarks.md).
// The front-end picks one for the whole pool (worker/kernels/
// lm_head_kernel_choice.h) and sends it in JoinReply.lm_head_cpu_kernel, so
// every worker, and the pool after a re-formation, computes the same bits.
// tf32 and fp32 have one CPU kernel (f32 matmul) and ignore the choice.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"

namespace logprob {

/// kAuto: the front-end chooses (ISA, then a short measurement); a
/// LmHeadGemm given kAuto uses kBf16 where oneDNN has a bf16 matmul, else
/// kWiden.
enum class LmHeadCpuKernel { kAuto, kBf16, kWiden };

/// Parses a --lm-head-cpu-kernel value: "auto", "bf16" or "widen" (exact,
/// lower case). INVALID_ARGUMENT naming `flag` and the accepted values
/// otherwise.
absl::StatusOr<LmHeadCpuKernel> ParseLmHeadCpuKernel(std::string_view value,
                                                     std::string_view flag = "--lm-head-cpu-kernel");

/// The flag spelling of `k` ("auto", "bf16", "widen").
const char* LmHeadCpuKernelName(LmHeadCpuKernel k);

}  // namespace logprob
