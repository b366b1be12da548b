// The pool's CPU kernel for the bf16 lm_head GEMM (common/lm_head_cpu_kernel.h),
// chosen once by the front-end, which sends it to every worker in
// JoinReply.lm_head_cpu_kernel (issue 45). Both kernels compute the bf16
// precision's exact products with f32 accumulation; only the faster one
// differs by CPU: AMX makes bf16 dot products the fastest, without AMX the
// f32 FMA units usually are (docs/benchmarks.md, "The box's limit").
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/lm_head_cpu_kernel.h"

namespace logprob::kernels {

/// oneDNN's effective ISA on this CPU ("avx2", "avx512_core_bf16",
/// "avx512_core_amx", ...; ONEDNN_MAX_CPU_ISA caps it). Thread-safe.
std::string EffectiveCpuIsa();

/// One timing of both kernels on the same tile GEMM ([rows, H] x [H,
/// cols], bf16 operands): the median GFLOP/s of interleaved rounds.
struct LmHeadKernelFigures {
  int64_t rows = 0, cols = 0, hidden_size = 0;
  int threads = 0;
  double bf16_gflops = 0, widen_gflops = 0;
};

/// Times both kernels (LmHeadGemm with kBf16 and with kWiden, bf16 weights
/// [cols, H] and hidden states [rows, H], `threads` OpenMP threads, 0: all)
/// over `rounds` interleaved rounds after one warm-up each. Needs
/// Bf16MatmulSupported() (FAILED_PRECONDITION otherwise); INVALID_ARGUMENT
/// for a size <= 0. Takes a few milliseconds at H = 1024 (rows 128, cols
/// 1024, 5 rounds); sets the calling thread's OpenMP thread count when
/// `threads` > 0. Not for concurrent use with other GEMMs when timing matters.
absl::StatusOr<LmHeadKernelFigures> MeasureLmHeadKernels(int64_t hidden_size, int threads, int64_t rows = 128,
                                                         int64_t cols = 1024, int rounds = 5);

/// The kernel a pool uses, and why (for the front-end's log line).
struct LmHeadKernelChoice {
  LmHeadCpuKernel kernel = LmHeadCpuKernel::kBf16;
  std::string why;
};

/// Resolves `requested` for a pool whose workers run on this CPU with
/// `threads` GEMM threads each, for heads of `hidden_size`:
///  - kBf16 or kWiden: kept (kBf16 FAILED_PRECONDITION without a bf16
///    matmul here: the flag names the alternative);
///  - kAuto: kWiden without a bf16 matmul (AVX2); kBf16 with AMX (its bf16
///    tiles outrun the f32 units several times); otherwise (AVX-512 with or
///    without BF16 instructions, no AMX) the faster of the two in
///    MeasureLmHeadKernels on the head's H, kBf16 unless kWiden is at
///    least 5% faster (a measurement in noise keeps the native kernel);
///    kBf16 without measuring when `hidden_size` <= 0 (no head).
/// Never returns kAuto. The measurement makes the choice depend on the
/// load of the moment where the two are close: replicas that must give
/// the same bits set the flag (the log line and ServerInfo say what auto chose).
absl::StatusOr<LmHeadKernelChoice> ChooseLmHeadCpuKernel(LmHeadCpuKernel requested, int64_t hidden_size, int threads);

}  // namespace logprob::kernels
