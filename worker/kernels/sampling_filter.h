// Sampling filters on one full row (NeMo-RL `apply_top_k_top_p`
// semantics, docs/SPEC.md "Filters").
#pragma once

#include <cstdint>
#include <vector>

namespace logprob::kernels {

/// Returns the smallest x that survives temperature-scaled top-k then top-p
/// filtering of the row `x[0..V)` (x already divided by temperature);
/// entries below it are filtered out. top-k keeps x >= kth largest (ties
/// kept; top_k <= 0 or >= V disables); top-p (0 < top_p < 1; otherwise
/// disabled) keeps, over the top-k survivors renormalised, each value whose
/// strictly-greater probability mass is < top_p (the largest always stays).
/// `scratch` is reused between calls.
float SamplingKeepMin(const float* x, int64_t V, int top_k, float top_p, std::vector<float>* scratch);

}  // namespace logprob::kernels
