// --lm-head-precision: the arithmetic of the hidden-states lm_head GEMM
// (logits = hidden_states @ lm_head.weight^T), shared by logprob-server
// (flag, ServerInfo), logprob-worker and both GEMM backends.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/tf32_round.h"

namespace logprob {

/// What the lm_head GEMM multiplies; every choice accumulates and outputs
/// float32.
///  - kAuto: by the checkpoint's dtype: BF16 weights -> kBf16, F32 and F16
///    weights -> kFp32 (F16 widens exactly).
///  - kBf16: weights and hidden states rounded to bf16 (round to nearest
///    even) where they are not already bf16: a bf16 model's lm_head.
///  - kTf32: weights and hidden states widened to f32, multiplied with tf32
///    operands (10 explicit mantissa bits): on the GPU cuBLASLt's
///    CUBLAS_COMPUTE_32F_FAST_TF32 (tensor cores); on the CPU both operands
///    are rounded to tf32 (round to nearest even) and multiplied in f32,
///    which emulates tf32 operand rounding with f32 accumulation.
///  - kFp32: weights and hidden states widened exactly to f32, an f32 GEMM
///    (on the GPU CUBLAS_COMPUTE_32F, no TF32): for rollout engines that
///    compute the head in fp32 (e.g. vLLM's head_dtype).
enum class LmHeadPrecision { kAuto, kBf16, kTf32, kFp32 };

/// Parses a --lm-head-precision value: "auto", "bf16", "tf32" or "fp32"
/// (exact, lower case). INVALID_ARGUMENT naming `flag` and the accepted
/// values otherwise.
absl::StatusOr<LmHeadPrecision> ParseLmHeadPrecision(std::string_view value,
                                                     std::string_view flag = "--lm-head-precision");

/// The flag spelling of `p` ("auto", "bf16", "tf32", "fp32").
const char* LmHeadPrecisionName(LmHeadPrecision p);

/// `p` with kAuto resolved for weights of `weight_dtype` (F32, BF16 or F16):
/// never kAuto.
LmHeadPrecision ResolveLmHeadPrecision(LmHeadPrecision p, DType weight_dtype);

/// Bytes of lm_head weights a worker holds for `rows` rows of
/// `hidden_size` values of `weight_dtype` at precision `p` (kAuto resolved
/// by the dtype), the one rule of the front-end's accounting
/// (GetServerInfo bytes_per_worker, --lm-head-memory-bytes,
/// logprob_lm_head_retained_bytes) and of the workers. A CPU worker
/// (`device` false) keeps the weights in their checkpoint dtype, mapped
/// from the store or copied, whatever the CPU's matmul (LmHeadGemm converts
/// one column tile at a time; the converted last partial tile, at most
/// 128 x hidden_size x 4 bytes, is not counted). A GPU worker holds the
/// GEMM's operands on its device: bf16 for kBf16, f32 for kTf32 and kFp32.
/// The bias (rows floats) is not counted.
int64_t LmHeadWorkerBytes(int64_t rows, int64_t hidden_size, DType weight_dtype, LmHeadPrecision p, bool device);

}  // namespace logprob
