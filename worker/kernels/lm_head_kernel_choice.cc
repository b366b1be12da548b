#include "worker/kernels/lm_head_kernel_choice.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::kernels {

std::string EffectiveCpuIsa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return absl::StrCat("isa ", static_cast<int>(dnnl::get_effective_cpu_isa()));
  }
}

namespace {

/// `n` bf16 values, a fixed pattern in [-0.5, 0.5) (timing needs no randomness).
std::vector<char> Bf16Pattern(int64_t n, uint32_t seed) {
  std::vector<char> out(static_cast<size_t>(n) * 2);
  auto* v = reinterpret_cast<uint16_t*>(out.data());
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = FloatToBf16(static_cast<float>(x >> 8) / 16777216.0f - 0.5f);
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

absl::StatusOr<LmHeadKernelFigures> MeasureLmHeadKernels(int64_t hidden_size, int threads, int64_t rows, int64_t cols,
                                                         int rounds) {
  if (hidden_size <= 0 || rows <= 0 || cols <= 0 || rounds <= 0)
    return absl::InvalidArgumentError(absl::StrCat("kernel measurement sizes must be positive, got H ", hidden_size,
                                                   ", rows ", rows, ", cols ", cols, ", rounds ", rounds));
  if (!Bf16MatmulSupported())
    return absl::FailedPreconditionError("no bf16 matmul on this CPU: only the widen kernel runs here");
  const std::vector<char> weight = Bf16Pattern(cols * hidden_size, 1), hidden = Bf16Pattern(rows * hidden_size, 2);
  LmHeadCpuKernel kernels[2] = {LmHeadCpuKernel::kBf16, LmHeadCpuKernel::kWiden};
  std::unique_ptr<LmHeadGemm> gemms[2];
  for (int k = 0; k < 2; ++k) {
    LOGPROB_ASSIGN_OR_RETURN(
        gemms[k], LmHeadGemm::Create(v1::BF16, weight, cols, hidden_size, threads, LmHeadPrecision::kBf16, kernels[k]));
  }
  std::vector<float> out(static_cast<size_t>(rows * cols));
  std::vector<double> seconds[2];
  for (int r = -1; r < rounds; ++r)  // round -1: warm-up (oneDNN's JIT, first touch)
    for (int k = 0; k < 2; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      LOGPROB_RETURN_IF_ERROR(gemms[k]->Compute(v1::BF16, hidden.data(), rows, out.data()));
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      if (r >= 0) seconds[k].push_back(std::max(dt.count(), 1e-9));
    }
  LmHeadKernelFigures f;
  f.rows = rows;
  f.cols = cols;
  f.hidden_size = hidden_size;
  f.threads = threads;
  const double flop = 2.0 * static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(hidden_size);
  f.bf16_gflops = flop / Median(seconds[0]) * 1e-9;
  f.widen_gflops = flop / Median(seconds[1]) * 1e-9;
  return f;
}

absl::StatusOr<LmHeadKernelChoice> ChooseLmHeadCpuKernel(LmHeadCpuKernel requested, int64_t hidden_size, int threads) {
  const std::string isa = EffectiveCpuIsa();
  LmHeadKernelChoice c;
  if (requested != LmHeadCpuKernel::kAuto) {
    c.kernel = requested;
    c.why = absl::StrCat("set by --lm-head-cpu-kernel (ISA ", isa, ")");
    // The workers' own rule (GemmComputeDType), checked here first.
    if (absl::StatusOr<DType> runs = GemmComputeDType(LmHeadPrecision::kBf16, requested); !runs.ok())
      return absl::FailedPreconditionError(absl::StrCat("--lm-head-cpu-kernel ", LmHeadCpuKernelName(requested),
                                                        " (ISA ", isa, "): ", runs.status().message()));
    return c;
  }
  if (!Bf16MatmulSupported()) {
    c.kernel = LmHeadCpuKernel::kWiden;
    c.why = absl::StrCat("auto: ISA ", isa, " has no bf16 matmul");
    return c;
  }
  if (dnnl::get_effective_cpu_isa() == dnnl::cpu_isa::avx512_core_amx) {
    c.kernel = LmHeadCpuKernel::kBf16;
    c.why = absl::StrCat("auto: ISA ", isa, " (AMX bf16 tiles)");
    return c;
  }
  if (hidden_size <= 0) {  // no head yet: nothing scores hidden states, nothing to measure on
    c.kernel = LmHeadCpuKernel::kBf16;
    c.why = absl::StrCat("auto: ISA ", isa, ", no lm_head to measure on");
    return c;
  }
  LOGPROB_ASSIGN_OR_RETURN(const LmHeadKernelFigures f, MeasureLmHeadKernels(hidden_size, threads));
  c.kernel = f.widen_gflops >= 1.05 * f.bf16_gflops ? LmHeadCpuKernel::kWiden : LmHeadCpuKernel::kBf16;
  c.why = absl::StrFormat(
      "auto: ISA %s, measured on [%d, %d] x [%d, %d], %d thread(s): bf16 %.1f GFLOP/s, widen %.1f GFLOP/s", isa, f.rows,
      f.hidden_size, f.hidden_size, f.cols, threads, f.bf16_gflops, f.widen_gflops);
  return c;
}

}  // namespace logprob::kernels
