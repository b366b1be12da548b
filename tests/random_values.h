// Random tensors for the kernel and scorer tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"

namespace logprob::testing {

/// `n` values of `dtype` (F32 or BF16, bytes in host order) drawn from
/// normal(0, sigma) with `rng`; BF16 values are the draws rounded to nearest even.
inline std::vector<char> RandomValues(DType dtype, int64_t n, float sigma, std::mt19937& rng) {
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

}  // namespace logprob::testing
