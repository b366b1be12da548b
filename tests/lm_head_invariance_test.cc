// Batch invariance of the CPU lm_head GEMM (kernels::LmHeadGemm): a row's
// logits are bitwise the same whatever the number of rows M multiplied
// with it and wherever it sits among them, for every compute dtype. The
// scorer relies on it: a request's rows land in GEMMs of different M
// depending on what shares their batch and round.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::kernels {
namespace {

std::vector<char> Random(DType dtype, int64_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, sigma);
  std::vector<char> out(static_cast<size_t>(n) * DTypeSize(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float v = normal(rng);
    if (dtype == v1::BF16) {
      const uint16_t b = FloatToBf16(v);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &v, 4);
    }
  }
  return out;
}

/// Rows of one [n, H] batch multiplied as sub-batches of every M, at the
/// start, one row in and at the end, give the batch's bits.
void ExpectInvariant(int64_t H) {
  const int64_t N = 301, n = 300;
  for (DType dtype : {v1::BF16, v1::F32}) {
    SCOPED_TRACE(DTypeName(dtype));
    auto gemm = LmHeadGemm::Create(dtype, Random(dtype, N * H, 0.3f, 1), N, H, /*threads=*/1);
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
