// The head's logit transform (common/lm_head_transform.h) on the CPU with
// SIMD (Highway, runtime dispatch): what the CPU backend applies to its
// GEMM output.
#pragma once

#include <cstdint>

#include "common/lm_head_transform.h"

namespace logprob::kernels {

/// logits[M, N] (f32, row-major, in place) = softcap(scale * (x + bias[n]))
/// for each element, as ApplyLmHeadTransform (same operations in the same
/// order in float32: the add, the multiply, then c * tanh(y / c)), with
/// Highway's vector Tanh (within a few ulp of tanhf) instead of tanhf:
/// about 20x faster for a softcapped head. Every element goes through the
/// same lane-wise vector operations (the ragged end of a row too, through
/// a padded vector), so its value depends only on its own input, bias and
/// the scalars: never on M, its row or its position (batch invariance).
/// `bias` [N] or null (t.has_bias false). Thread-safe on distinct buffers.
void ApplyLmHeadTransformSimd(const LmHeadTransform& t, const float* bias, int64_t M, int64_t N, float* logits);

}  // namespace logprob::kernels
