// Batch invariance of the CPU lm_head GEMM (kernels::LmHeadGemm): a row's
// logits are bitwise the same whatever the number of rows M multiplied
// with it and wherever it sits among them, for every compute dtype. The
// scorer relies on it: a request's rows land in GEMMs of different M
// depending on what shares their batch and round.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "tests/random_values.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::kernels {
namespace {

std::vector<char> Random(DType dtype, int64_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  return testing::RandomValues(dtype, n, sigma, rng);
}

/// Rows of one [n, H] batch multiplied as sub-batches of every M, at the
/// start, one row in and at the end, give the batch's bits: F32 weights,
/// and BF16 weights with each CPU kernel of the bf16 precision (widen, and
/// bf16 dot products where oneDNN has them; common/lm_head_cpu_kernel.h).
void ExpectInvariant(int64_t H) {
  const int64_t N = 301, n = 300;
  std::vector<std::pair<DType, LmHeadCpuKernel>> cases = {{v1::BF16, LmHeadCpuKernel::kWiden},
                                                          {v1::F32, LmHeadCpuKernel::kAuto}};
  if (Bf16MatmulSupported()) cases.push_back({v1::BF16, LmHeadCpuKernel::kBf16});
  for (const auto& [dtype, kernel] : cases) {
    SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << ", kernel " << LmHeadCpuKernelName(kernel));
    auto gemm =
        LmHeadGemm::Create(dtype, Random(dtype, N * H, 0.3f, 1), N, H, /*threads=*/1, LmHeadPrecision::kAuto, kernel);
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    const std::vector<char> hidden = Random(dtype, n * H, 1.0f, 2);
    const size_t row = static_cast<size_t>(H) * DTypeSize(dtype);
    std::vector<float> all(n * N), part(n * N);
    ASSERT_TRUE((*gemm)->Compute(dtype, hidden.data(), n, all.data()).ok());
    for (int64_t M : {1, 2, 3, 7, 15, 16, 17, 32, 64, 100, 128, 150, 256}) {
      for (int64_t r0 : {int64_t{0}, int64_t{1}, n - M}) {
        ASSERT_TRUE((*gemm)->Compute(dtype, hidden.data() + r0 * row, M, part.data()).ok());
        EXPECT_EQ(std::memcmp(part.data(), all.data() + r0 * N, static_cast<size_t>(M * N) * 4), 0)
            << "rows [" << r0 << ", " << r0 + M << ") multiplied as M = " << M << " differ from M = " << n;
      }
    }
  }
}

TEST(LmHeadGemmInvariance, ARowsLogitsDoNotDependOnMOrPositionH64) { ExpectInvariant(64); }
TEST(LmHeadGemmInvariance, ARowsLogitsDoNotDependOnMOrPositionH1024) { ExpectInvariant(1024); }

}  // namespace
}  // namespace logprob::kernels
