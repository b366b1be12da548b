// float32 -> tf32 rounding, the one rule the CPU's tf32 operands
// (worker/kernels/lm_head_gemm.cc) and the GPU backward's
// (worker/cuda/backward_kernels.cu) share. No dependencies beyond
// common/host_device.h, so nvcc compiles it as is.
#pragma once

#include <stdint.h>
#include <string.h>

#include "common/host_device.h"

namespace logprob {

/// float32 -> the nearest tf32 value (8 exponent bits, 10 explicit mantissa
/// bits; round to nearest, ties to even), returned as float32. NaN and
/// infinities pass through; values rounding past FLT_MAX become infinity.
LOGPROB_HOST_DEVICE inline float RoundToTf32(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) != 0x7f800000u) {  // finite: add half an ulp (ties to even), drop 13 bits
    u += 0x0fffu + ((u >> 13) & 1u);
    u &= ~0x1fffu;
  }
  memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace logprob
