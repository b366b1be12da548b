// logits = hidden_states @ W^T for one worker's vocabulary slice W of the
// lm_head (rows [vocab_begin, vocab_end) of the [V, H] weight), with a
// oneDNN matmul (f32 accumulation, f32 output).
//
// Operands by LmHeadPrecision (common/lm_head_precision.h): bf16 (auto for
// BF16 weights) runs a bf16 x bf16 -> f32 matmul (weights and hidden states
// of another dtype rounded to bf16 first, as a bf16 model's lm_head sees
// them); fp32 (auto for F32 and F16 weights) widens both exactly and runs
// in f32; tf32 widens both, rounds them to tf32 (round to nearest even)
// and runs in f32: the CPU emulates tf32 operand rounding, with f32
// accumulation. Weights are converted once at load.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/host_bytes.h"
#include "common/lm_head_precision.h"

namespace logprob::kernels {

/// Checks an lm_head slice as read from the checkpoint: `dtype` F32, BF16
/// or F16, rows and hidden_size > 0, weight_bytes == rows * hidden_size *
/// element size (without overflow). INVALID_ARGUMENT naming what is wrong.
absl::Status CheckLmHeadWeight(DType dtype, size_t weight_bytes, int64_t rows, int64_t hidden_size);

/// OK when hidden states of `dtype` can be multiplied (F32, BF16 or F16);
/// else INVALID_ARGUMENT naming the dtype. Shared by the CPU and GPU GEMMs.
absl::Status CheckHiddenStatesDType(DType dtype);

/// True when oneDNN can run a bf16 x bf16 -> f32 matmul on this CPU
/// (avx512_core or newer on x86); probed once. Thread-safe.
bool Bf16MatmulSupported();

/// A worker's lm_head slice and the GEMM that maps hidden states to its
/// logits columns. Not thread-safe: one Compute at a time.
class LmHeadGemm {
 public:
  /// Takes the slice `weight` ([rows, hidden_size] row-major, `dtype` F32,
  /// BF16 or F16, as read from the checkpoint; owned or a read-only mapping
  /// of a store file). Weights already in the compute dtype are multiplied
  /// in place (a mapping stays shared with the file); others are converted
  /// into a buffer of their own. `threads` > 0 caps the
  /// matmul's threads (0: the library default, all cores): oneDNN runs on
  /// OpenMP, so this calls omp_set_num_threads(threads) here and before
  /// each Compute, changing the calling thread's OpenMP default.
  /// `precision` picks the operands (header comment; kAuto by `dtype`).
  /// INVALID_ARGUMENT for a bad dtype, rows or H <= 0, or a size not
  /// matching rows * H; INTERNAL if oneDNN cannot make a CPU engine.
  static absl::StatusOr<std::unique_ptr<LmHeadGemm>> Create(DType dtype, HostBytes weight, int64_t rows,
                                                            int64_t hidden_size, int threads = 0,
                                                            LmHeadPrecision precision = LmHeadPrecision::kAuto);
  ~LmHeadGemm();

  int64_t rows() const { return rows_; }                // N: vocab slice length
  int64_t hidden_size() const { return hidden_size_; }  // H
  /// BF16 or F32. The bf16 precision computes in F32 when this CPU's oneDNN
  /// has no bf16 matmul (e.g. AVX2 only): the bf16 weights are widened
  /// exactly and the hidden states rounded to bf16 as for the bf16 matmul,
  /// so the operands and the f32 accumulation are the same (up to summation
  /// order). tf32 and fp32 compute in F32.
  DType compute_dtype() const { return compute_dtype_; }
  /// The precision in effect: bf16, tf32 or fp32 (kAuto resolved).
  LmHeadPrecision precision() const { return precision_; }
  /// Bytes of the slice in compute dtype (rows() x H; the padding to whole
  /// column tiles not counted).
  size_t weight_bytes() const { return static_cast<size_t>(rows_ * hidden_size_) * DTypeSize(compute_dtype_); }

  /// out[M, rows()] (f32, row-major) = hidden[M, H] @ weight^T, `hidden`
  /// of `hidden_dtype` (F32, BF16 or F16). M may vary between calls (M == 0
  /// is a no-op): every call runs the same tile matmul, so a row's logits
  /// are bitwise the same whatever M and the row's position.
  /// INVALID_ARGUMENT for a bad dtype, M < 0 or null buffers, INTERNAL if
  /// oneDNN fails.
  absl::Status Compute(DType hidden_dtype, const void* hidden, int64_t M, float* out);

 private:
  struct Impl;
  LmHeadGemm(DType compute_dtype, HostBytes weight, int64_t rows, int64_t hidden_size);
  DType compute_dtype_;
  LmHeadPrecision precision_ = LmHeadPrecision::kFp32;
  // F32 compute: rounding applied to hidden states first (kBf16 when bf16
  // runs in f32, kTf32 for tf32; kFp32: none).
  LmHeadPrecision hidden_rounding_ = LmHeadPrecision::kFp32;
  HostBytes weight_;        // [rows, H] of compute_dtype_ (whole column tiles are read in place)
  std::vector<char> tail_;  // the last column tile if partial: its rows, then zero rows to kTileCols
  int64_t rows_, hidden_size_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace logprob::kernels
