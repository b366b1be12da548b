// Element types of tensors on the wire and in safetensors files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "logprob/v1/logprob.pb.h"

namespace logprob {

using DType = ::logprob::v1::DType;

/// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED or unknown values.
size_t DTypeSize(DType dtype);

/// Safetensors spelling of `dtype` ("F32", "BF16", "F16", "I32", "I64").
const char* DTypeName(DType dtype);

/// Parses a safetensors dtype name. Returns false for names this service
/// does not handle (e.g. "F64", "U8").
bool ParseDTypeName(std::string_view name, DType* dtype);

/// True for the floating-point dtypes accepted as logits / hidden states.
inline bool IsFloatDType(DType d) { return d == v1::F32 || d == v1::BF16 || d == v1::F16; }
/// True for the integer dtypes accepted as ids / lengths.
inline bool IsIntDType(DType d) { return d == v1::I32 || d == v1::I64; }

/// bfloat16 bits -> float32 (exact).
inline float Bf16ToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// IEEE binary16 bits -> float32 (exact, via the compiler's _Float16).
inline float F16ToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

/// float32 -> bfloat16 bits, round to nearest even (NaN stays NaN).
uint16_t FloatToBf16(float f);
/// float32 -> IEEE binary16 bits, round to nearest even.
uint16_t FloatToF16(float f);

/// Converts `n` little-endian elements of float dtype `dtype` at `src`
/// to float32 at `dst`. `dtype` must satisfy IsFloatDType.
void ToFloat(DType dtype, const void* src, size_t n, float* dst);

/// Reads element `i` of an integer tensor (I32 or I64) as int64.
inline int64_t ReadInt(DType dtype, const void* data, size_t i) {
  if (dtype == v1::I32) {
    int32_t v;
    std::memcpy(&v, static_cast<const char*>(data) + i * 4, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, static_cast<const char*>(data) + i * 8, 8);
  return v;
}

}  // namespace logprob
