// One logit of a head with a transform (common/lm_head_transform.h), the
// element function the CPU path and the CUDA kernel
// (worker/cuda/lm_head_transform.cu) share. No dependencies beyond
// common/host_device.h, so nvcc
// compiles it as is.
#pragma once

#include <math.h>

#include "common/host_device.h"

namespace logprob {

/// softcap(scale * (x + bias)) in float32, softcap(y) = c * tanh(y / c)
/// with c = `softcap` (0: none): the GEMM output x of one logit, its
/// column's bias (0 without one) and the head's scalars rounded to float
/// once (scale 1 when none). The models' order (and TRL's): bias, then the
/// multiplier, then the softcap.
LOGPROB_HOST_DEVICE inline float TransformLogit(float x, float bias, float scale, float softcap) {
  float z = (x + bias) * scale;
  if (softcap != 0.0f) z = softcap * tanhf(z / softcap);
  return z;
}

}  // namespace logprob
