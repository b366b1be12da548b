// Cheap deterministic test data of the CUDA benchmark and the GPU
// batch-invariance checks: rows of pseudo-random values from a hash of
// (key, column), no RNG state, so any row can be rebuilt from its key alone.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// A 32-bit mix of (key, i) (a few multiply-xorshift rounds).
inline uint32_t HashMix(uint64_t key, uint64_t i) {
  uint64_t h = (key * 0x9E3779B97F4A7C15ull) ^ (i * 0xC2B2AE3D27D4EB4Full);
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return static_cast<uint32_t>(h ^ (h >> 32));
}

/// Writes n values scale * uniform(-1, 1) of `dtype` (F32, BF16 or F16) to
/// `out` (n * DTypeSize(dtype) bytes), determined by `key` alone.
inline void HashFill(uint64_t key, size_t n, float scale, DType dtype, char* out) {
  for (size_t i = 0; i < n; ++i) {
    const float f = scale * (static_cast<float>(HashMix(key, i) & 0xffffff) / 8388608.f - 1.f);
    if (dtype == v1::F32) {
      std::memcpy(out + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == v1::BF16 ? FloatToBf16(f) : FloatToF16(f);
      std::memcpy(out + 2 * i, &h, 2);
    }
  }
}

/// HashFill into a new buffer.
inline std::vector<char> HashBytes(uint64_t key, size_t n, float scale, DType dtype) {
  std::vector<char> out(n * DTypeSize(dtype));
  HashFill(key, n, scale, dtype, out.data());
  return out;
}

/// A bf16 lm_head slice [V, H] of scale 0.05 * uniform(-1, 1): with hidden
/// states of scale 1 the logits have a standard deviation of about
/// 0.03 * sqrt(H) (about 2 for H = 4096).
inline LmHeadSlice HashLmHead(int64_t V, int64_t H, uint64_t key) {
  LmHeadSlice s;
  s.dtype = v1::BF16;
  s.rows = V;
  s.hidden_size = H;
  s.weight = HashBytes(key, static_cast<size_t>(V * H), 0.05f, v1::BF16);
  return s;
}

}  // namespace logprob
