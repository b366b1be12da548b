// SIMD building blocks of the row statistics and of the lm_head GEMM's
// operand widening (Highway, runtime dispatch to the best instruction set
// of the machine: AVX-512, AVX2, SSE4, ...).
#pragma once

#include <cstddef>

#include "common/dtype.h"

namespace logprob::kernels {

/// Elements per block of PrepareBlock / ExpSums.
constexpr size_t kBlock = 2048;
/// A block buffer's size: kBlock plus room for padding to whole vectors.
constexpr size_t kBlockBufferFloats = kBlock + 64;

/// Converts n <= kBlock elements of `dtype` at `src` to float32 in `dst`,
/// divides by `temperature` (when != 1), sets values below `keep_min` to
/// -inf, pads `dst` with -inf to a whole number of vector pairs, and
/// returns the block's max. Returns the padded length in *padded.
/// When `sum` is not null, *sum = the sum of the n values after the
/// division and before the keep_min filter (float32 lanes, summed at the
/// end; the mean_logits statistic). Deterministic for given inputs.
float PrepareBlock(DType dtype, const void* src, size_t n, float temperature, float keep_min, float* dst,
                   size_t* padded, float* sum = nullptr);

/// Over x[0..n) (n from PrepareBlock's *padded), with d = x - m:
/// *s = sum exp(d), *u = sum exp(d) * d (terms with exp(d) == 0 skipped),
/// *q = sum exp(d)^2 (= sum exp(2d), the log_sum_sq_probs statistic).
/// u and q may be null when not wanted. Lane-wise float accumulation,
/// summed at the end.
void ExpSums(const float* x, size_t n, float m, float* s, float* u, float* q = nullptr);

/// The first index i in [begin, n) with x[i] > floor or x[i] NaN (top-k
/// ranks NaN above every number: row_stats.cc), or n.
size_t NextAbove(const float* x, size_t begin, size_t n, float floor);

/// ToFloat (common/dtype.h) in vectors: `n` values of `dtype` (F32, BF16
/// or F16) at `src` widened exactly to float32 in `dst`, bit for bit what
/// ToFloat gives. The lm_head GEMM widens every bf16 weight tile with it
/// (the widen kernel, and bf16 operands without a bf16 matmul).
void WidenToFloat(DType dtype, const void* src, size_t n, float* dst);

}  // namespace logprob::kernels
