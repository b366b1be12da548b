#include "common/dtype.h"

namespace logprob {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case v1::F32:
      return 4;
    case v1::BF16:
      return 2;
    case v1::F16:
      return 2;
    case v1::I32:
      return 4;
    case v1::I64:
      return 8;
    default:
      return 0;
  }
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case v1::F32:
      return "F32";
    case v1::BF16:
      return "BF16";
    case v1::F16:
      return "F16";
    case v1::I32:
      return "I32";
    case v1::I64:
      return "I64";
    default:
      return "UNSPECIFIED";
  }
}

bool ParseDTypeName(std::string_view name, DType* dtype) {
  static constexpr struct {
    std::string_view n;
    DType d;
  } kNames[] = {{"F32", v1::F32}, {"BF16", v1::BF16}, {"F16", v1::F16}, {"I32", v1::I32}, {"I64", v1::I64}};
  for (const auto& e : kNames) {
    if (e.n == name) {
      *dtype = e.d;
      return true;
    }
  }
  return false;
}

uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t FloatToF16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

void ToFloat(DType dtype, const void* src, size_t n, float* dst) {
  switch (dtype) {
    case v1::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case v1::BF16: {
      const auto* p = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        dst[i] = Bf16ToFloat(b);
      }
      return;
    }
    case v1::F16: {
      const auto* p = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        dst[i] = F16ToFloat(b);
      }
      return;
    }
    default:
      return;
  }
}

}  // namespace logprob
