// The box's GEMM limit, which the CPU benches state beside their figures:
// oneDNN's own fp32 GEMM (dnnl_sgemm, one call over the whole shape, on the
// same OpenMP threads) and the CPU's model; the ISA oneDNN runs at is
// kernels::EffectiveCpuIsa (worker/kernels/lm_head_kernel_choice.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"

namespace logprob::bench {

/// The CPU's model name (/proc/cpuinfo "model name"; "unknown").
std::string CpuModelName();

/// C[M, N] = A[M, K] x B[N, K]^T in fp32 with oneDNN's sgemm on `threads`
/// OpenMP threads (0: the default), on fixed random data held here: the
/// lm_head GEMM's shape (B: the [N, K] head, row-major) at the library's
/// best fp32. Not thread-safe.
class ReferenceSgemm {
 public:
  ReferenceSgemm(int64_t M, int64_t N, int64_t K, int threads);
  ~ReferenceSgemm();
  /// One GEMM; INTERNAL when oneDNN fails.
  absl::Status Run();
  /// 2 * M * N * K.
  double flops() const;

 private:
  struct Data;
  std::unique_ptr<Data> d_;
};

}  // namespace logprob::bench
