// logits = hidden_states @ W^T for one worker's vocabulary slice W of the
// lm_head (rows [vocab_begin, vocab_end) of the [V, H] weight), with a
// oneDNN matmul (f32 accumulation, f32 output).
//
// Operands by LmHeadPrecision (common/lm_head_precision.h): bf16 (auto for
// BF16 weights) multiplies bf16 operands (weights and hidden states of
// another dtype rounded to bf16 first, as a bf16 model's lm_head sees
// them) with f32 accumulation, by one of two kernels (LmHeadCpuKernel,
// common/lm_head_cpu_kernel.h): a bf16 x bf16 -> f32 matmul, or the
// operands widened exactly to f32 and an f32 matmul; fp32 (auto for F32 and F16 weights) widens both exactly and runs
// in f32; tf32 widens both, rounds them to tf32 (round to nearest even)
// and runs in f32: the CPU emulates tf32 operand rounding, with f32
// accumulation. The weights are kept as given (in their checkpoint dtype;
// a mapping of a store file stays shared with it) and each column tile is
// converted to the operands as the GEMM multiplies it, into a buffer of
// the thread's own that every call reuses: a new version allocates and
// first-touches no converted copy, on any CPU (issue 34).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/host_bytes.h"
#include "common/lm_head_cpu_kernel.h"
#include "common/lm_head_precision.h"

namespace logprob::kernels {

/// Checks an lm_head slice as read from the checkpoint: `dtype` F32, BF16
/// or F16, rows and hidden_size > 0, weight_bytes == rows * hidden_size *
/// element size (without overflow). INVALID_ARGUMENT naming what is wrong.
absl::Status CheckLmHeadWeight(DType dtype, size_t weight_bytes, int64_t rows, int64_t hidden_size);

/// OK when hidden states of `dtype` can be multiplied (F32, BF16 or F16);
/// else INVALID_ARGUMENT naming the dtype. Shared by the CPU and GPU GEMMs.
absl::Status CheckHiddenStatesDType(DType dtype);

/// Lm_head rows per column tile of the GEMM (each Compute multiplies
/// whole tiles; a partial last tile is zero-padded).
inline constexpr int64_t kLmHeadTileCols = 128;

/// True when values of `from` are already the GEMM operands of `compute`
/// (BF16 or F32) at precision `p`: the same dtype, and for an f32 GEMM at
/// bf16 or tf32 precision not F32 values (those are rounded first).
bool IsGemmOperand(DType from, DType compute, LmHeadPrecision p);

/// Converts `n` values of `from` (F32, BF16 or F16) at `src` to the
/// operands of a `compute` (BF16 or F32) GEMM at precision `p`, into
/// `dst` (n elements of `compute`): to bf16 round to nearest even (f16
/// widened exactly first); to f32 widened exactly, then rounded to bf16 or
/// tf32 values as `p` says (an emulated bf16 or tf32 matmul's operands).
/// The one conversion of both weights and hidden states. Thread-safe.
void ToOperands(DType from, const void* src, size_t n, DType compute, LmHeadPrecision p, void* dst);

/// True when oneDNN can run a bf16 x bf16 -> f32 matmul on this CPU
/// (avx512_core or newer on x86); probed once. Thread-safe.
bool Bf16MatmulSupported();

/// The dtype the GEMM multiplies in for precision `p` (resolved, not kAuto)
/// with `kernel`: BF16 for the bf16 precision with kBf16, or with kAuto
/// where Bf16MatmulSupported(); F32 otherwise (kWiden, tf32, fp32).
/// FAILED_PRECONDITION for kBf16 at bf16 precision on a CPU without a bf16
/// matmul (the pool's choice cannot be honoured here: same bits or none).
/// Thread-safe.
absl::StatusOr<DType> GemmComputeDType(LmHeadPrecision p, LmHeadCpuKernel kernel);

/// A worker's lm_head slice and the GEMM that maps hidden states to its
/// logits columns. Not thread-safe: one Compute at a time.
class LmHeadGemm {
 public:
  /// Takes the slice `weight` ([rows, hidden_size] row-major, `dtype` F32,
  /// BF16 or F16, as read from the checkpoint; owned or a read-only mapping
  /// of a store file) and keeps it as it is: weights that are not the
  /// compute operands are converted one column tile at a time in Compute
  /// (no converted copy of the slice). `threads` > 0 caps the
  /// matmul's threads (0: the library default, all cores): oneDNN runs on
  /// OpenMP, so this calls omp_set_num_threads(threads) here and before
  /// each Compute, changing the calling thread's OpenMP default.
  /// `precision` picks the operands (header comment; kAuto by `dtype`),
  /// `kernel` the bf16 precision's kernel (GemmComputeDType).
  /// INVALID_ARGUMENT for a bad dtype, rows or H <= 0, or a size not
  /// matching rows * H; FAILED_PRECONDITION for a kernel this CPU lacks;
  /// INTERNAL if oneDNN cannot make a CPU engine.
  static absl::StatusOr<std::unique_ptr<LmHeadGemm>> Create(DType dtype, HostBytes weight, int64_t rows,
                                                            int64_t hidden_size, int threads = 0,
                                                            LmHeadPrecision precision = LmHeadPrecision::kAuto,
                                                            LmHeadCpuKernel kernel = LmHeadCpuKernel::kAuto);
  ~LmHeadGemm();

  int64_t rows() const { return rows_; }                // N: vocab slice length
  int64_t hidden_size() const { return hidden_size_; }  // H
  /// BF16 or F32. The bf16 precision computes in F32 with the kWiden
  /// kernel, or when this CPU's oneDNN has no bf16 matmul (e.g. AVX2 only)
  /// and the kernel is kAuto: the bf16 weights are widened exactly and the
  /// hidden states rounded to bf16 as for the bf16 matmul, so the operands
  /// and the f32 accumulation are the same (up to summation order). tf32
  /// and fp32 compute in F32.
  DType compute_dtype() const { return compute_dtype_; }
  /// The precision in effect: bf16, tf32 or fp32 (kAuto resolved).
  LmHeadPrecision precision() const { return precision_; }
  /// The dtype the weights are held in (the checkpoint's, as given).
  DType weight_dtype() const { return weight_dtype_; }
  /// The slice's weights as given: [rows(), H] of weight_dtype().
  const char* weight_data() const { return weight_.data(); }
  /// Bytes held for the slice: rows() x H in weight_dtype(), plus the last
  /// partial column tile's converted copy (kLmHeadTileCols rows of the
  /// compute dtype).
  size_t weight_bytes() const { return weight_.size() + tail_.size(); }

  /// out[M, rows()] (f32, row-major) = hidden[M, H] @ weight^T, `hidden`
  /// of `hidden_dtype` (F32, BF16 or F16). M may vary between calls (M == 0
  /// is a no-op): every call runs the same tile matmul, so a row's logits
  /// are bitwise the same whatever M and the row's position.
  /// INVALID_ARGUMENT for a bad dtype, M < 0 or null buffers, INTERNAL if
  /// oneDNN fails.
  absl::Status Compute(DType hidden_dtype, const void* hidden, int64_t M, float* out);

 private:
  struct Impl;
  LmHeadGemm(DType weight_dtype, DType compute_dtype, LmHeadPrecision precision, HostBytes weight, int64_t rows,
             int64_t hidden_size);
  DType weight_dtype_, compute_dtype_;
  LmHeadPrecision precision_;
  HostBytes weight_;        // [rows, H] of weight_dtype_ (whole column tiles are read in place or converted per tile)
  std::vector<char> tail_;  // the last column tile if partial: its rows as operands, then zero rows to kTileCols
  int64_t rows_, hidden_size_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace logprob::kernels
