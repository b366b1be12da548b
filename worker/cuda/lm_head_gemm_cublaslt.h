// logits = hidden_states @ W^T for one worker's lm_head slice on the GPU
// (cuBLASLt), the device twin of kernels::LmHeadGemm with the same
// operands by LmHeadPrecision (common/lm_head_precision.h): bf16 (auto for
// BF16 weights) runs bf16 x bf16 -> f32 with f32 accumulation (other
// weights rounded to bf16 once at upload, on the device); fp32 (auto for
// F32 and F16 weights) widens the weights to F32 once at upload (on the
// device: converting_upload.h) and runs
// CUBLAS_COMPUTE_32F (no TF32); tf32 widens them too and runs
// CUBLAS_COMPUTE_32F_FAST_TF32 (tensor cores round the f32 operands to
// tf32 as the hardware does, f32 accumulation).
//
// Batch invariance: a row's logits must not depend on how many rows share
// its GEMM (M) or where it sits among them, so that a token scores the same
// bits alone or in any batch. cuBLASLt's heuristic picks kernels (tile
// shape, split-K, reduction scheme) by the whole problem shape, and a
// split-K or differently tiled kernel sums a row's H products in another
// order. So the algorithm is chosen once, at Create, for a fixed reference
// M (`algo_rows`), with split-K forced to 1 and no reduction scheme (one
// dot-product sequence per output), and that one algorithm runs every M;
// only the matrix layouts are per M. cuBLASLt documents no stream-K switch:
// the heuristic's descriptor is reused whole, so whatever decomposition it
// encodes is the same for every call.
//
// The GEMM runs over rows() rounded up to kLogitsAlign (zero weight rows
// past rows()), and its logits rows are logits_stride() floats apart. With
// an odd slice width (1001, 1501) the logits rows are not 16-byte aligned
// and the heuristic picked a kernel (cuBLASLt id 24 on an H200) whose bits
// for a row depended on the row's place among the GEMM's rows: the first
// GPU run of the staged two-rank test (2026-11-28) saw every moved row of
// the odd slice differ in its last bits. Aligned widths pick the kernels
// that the invariance tests hold.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/lm_head_precision.h"
#include "common/lm_head_transform.h"
#include "worker/cuda/device_buffers.h"

namespace logprob::cuda {

/// The lm_head slice in device memory and its GEMM. Not thread-safe.
class CublasLtLmHead {
 public:
  /// Uploads `weight` ([rows, hidden_size] row-major host bytes of `dtype`
  /// F32, BF16 or F16, the checkpoint layout) once, on the current device,
  /// converted for `precision` (header comment; kAuto by `dtype`), and picks
  /// the GEMM algorithm every M will use: cuBLASLt's heuristic at M =
  /// `algo_rows` (> 0; e.g. the backend's usual chunk rows), split-K 1, no
  /// reduction scheme (preferring candidates the heuristic configured
  /// without a split, so none depends on M; a split one is forced to
  /// split-K 1), checked with cublasLtMatmulAlgoCheck. Logs the choice to
  /// stderr (id, tile, stages, split-K, reduction, ...; algo_summary()).
  /// The device buffer of the weights comes from `recycler` when given (a
  /// released version's buffer of the same size: no cudaMalloc; it goes
  /// back there when this is destroyed, with this device current), else
  /// it is allocated and freed with this. Weights of another dtype than
  /// the GEMM's are converted on the device (UploadConverted) through a
  /// staging buffer of at most 64 MiB, taken from `staging_recycler` the
  /// same way and given back before Create returns (a load that converts
  /// nothing frees the idle staging buffer: TrimIdle). Recyclers keep idle
  /// only sizes still in use (common/buffer_recycler.h), so a vocabulary or
  /// precision change frees the old size's buffers once no version holds
  /// one. No host memory is allocated for the weights.
  /// INVALID_ARGUMENT for a bad dtype, shape, size or algo_rows; INTERNAL
  /// for CUDA or cuBLASLt failures (e.g. out of memory, no algorithm).
  static absl::StatusOr<std::unique_ptr<CublasLtLmHead>> Create(DType dtype, const void* weight, size_t weight_bytes,
                                                                int64_t rows, int64_t hidden_size,
                                                                LmHeadPrecision precision = LmHeadPrecision::kAuto,
                                                                int64_t algo_rows = kDefaultAlgoRows,
                                                                DeviceRecycler* recycler = nullptr,
                                                                DeviceRecycler* staging_recycler = nullptr);
  /// Reference M of the algorithm choice when the caller names none.
  static constexpr int64_t kDefaultAlgoRows = 256;
  ~CublasLtLmHead();

  int64_t rows() const { return rows_; }  // N
  /// Floats between consecutive rows of Compute's logits: rows() rounded up
  /// to kLogitsAlign (the entries past rows() hold the zero rows' logits,
  /// never a token's).
  int64_t logits_stride() const { return stride_; }
  /// The multiple of rows the GEMM runs over (64-byte aligned logits rows).
  static constexpr int64_t kLogitsAlign = 16;
  int64_t hidden_size() const { return hidden_size_; }      // H
  DType compute_dtype() const { return compute_dtype_; }    // BF16 or F32
  LmHeadPrecision precision() const { return precision_; }  // bf16, tf32 or fp32 (kAuto resolved)
  size_t weight_bytes() const { return weight_bytes_; }
  /// The head's logit transform Compute applies (identity until set).
  const LmHeadTransform& transform() const { return transform_; }
  /// The weights on the device: [logits_stride(), H] of compute_dtype(),
  /// row-major, rows past rows() zero (the backward's dL/dh operand).
  const void* weight() const { return weight_.get(); }

  /// Sets the head's logit transform (common/lm_head_transform.h) that
  /// Compute applies to the GEMM's output: `bias` [rows()] f32 (host; copied
  /// to the device before this returns) when t.has_bias, else empty.
  /// Call before any Compute. INVALID_ARGUMENT for a bias of another
  /// length; INTERNAL for CUDA failures.
  absl::Status SetTransform(const LmHeadTransform& t, const std::vector<float>& bias);

  /// The chosen algorithm's configuration as logged ("id 21, tile 27,
  /// stages 18, split-k 1, reduction 0, ...").
  const std::string& algo_summary() const { return algo_summary_; }

  /// logits[M, rows()] (device, f32, rows logits_stride() floats apart:
  /// [M, logits_stride()] is written) = hidden[M, H] @ W^T with
  /// `hidden` on the device in compute_dtype(), starting 256-byte aligned or
  /// a multiple of 16 rows after such a start; `logits` 256-byte aligned.
  /// Asynchronous on `stream`. Every M runs the algorithm chosen at Create
  /// (batch invariance, header comment). Then, unless transform() is the
  /// identity, the transform's element-wise kernel on the same stream
  /// (worker/cuda/lm_head_transform.h): logits = softcap(scale * (h W^T + b)).
  /// INTERNAL when that algorithm does not support this M
  /// (cublasLtMatmulAlgoCheck) or cuBLASLt fails.
  absl::Status Compute(const void* hidden, int64_t M, float* logits, cudaStream_t stream);

 private:
  struct Plan;  // layouts for one M, checked against algo_
  CublasLtLmHead() = default;
  /// Hidden [H, m] and logits [N, m] column-major layouts for m rows.
  absl::Status MakeLayouts(int64_t m, Plan* plan) const;
  /// Sets algo_: the heuristic's best split-K-free algorithm at algo_rows_.
  absl::Status ChooseAlgo();
  DType compute_dtype_ = v1::BF16;
  LmHeadPrecision precision_ = LmHeadPrecision::kBf16;
  int64_t rows_ = 0, hidden_size_ = 0;
  int64_t stride_ = 0;             // rows_ rounded up to kLogitsAlign
  DeviceRecycler::Buffer weight_;  // [stride_, H] of compute_dtype_ (rows past rows_ zero)
  size_t weight_bytes_ = 0;
  DeviceBuffer workspace_;
  LmHeadTransform transform_;
  DeviceBuffer bias_;  // [stride_] f32 when transform_.has_bias (zero past rows_)
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_layout_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};  // the one algorithm of every M (chosen at Create)
  int64_t algo_rows_ = 0;        // the M it was chosen for
  std::string algo_summary_;     // algo_'s configuration, as logged
  std::map<int64_t, std::unique_ptr<Plan>> plans_;
};

}  // namespace logprob::cuda
