#include "common/finite_check.h"

#include <algorithm>
#include <cstring>

namespace logprob {
namespace {

constexpr int64_t kBlock = 4096;

// Elements of type T whose bits & mask == mask (all exponent bits set).
template <typename T>
std::optional<int64_t> First(const void* data, int64_t n, T mask) {
  const char* bytes = static_cast<const char*>(data);
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    T any = 0;
    for (int64_t i = b; i < e; ++i) {
      T x;
      std::memcpy(&x, bytes + i * static_cast<int64_t>(sizeof(T)), sizeof(T));  // data may be unaligned
      any |= static_cast<T>((x & mask) == mask);
    }
    if (any == 0) continue;
    for (int64_t i = b; i < e; ++i) {
      T x;
      std::memcpy(&x, bytes + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
      if ((x & mask) == mask) return i;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<int64_t> FirstNonFinite(DType dtype, const void* data, int64_t n) {
  switch (dtype) {
    case v1::F32:
      return First<uint32_t>(data, n, 0x7F800000u);
    case v1::BF16:
      return First<uint16_t>(data, n, 0x7F80u);
    case v1::F16:
      return First<uint16_t>(data, n, 0x7C00u);
    default:
      return std::nullopt;
  }
}

}  // namespace logprob
