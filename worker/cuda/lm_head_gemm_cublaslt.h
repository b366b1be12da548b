// logits = hidden_states @ W^T for one worker's lm_head slice on the GPU
// (cuBLASLt), the device twin of kernels::LmHeadGemm with the same compute
// dtypes: BF16 weights run bf16 x bf16 -> f32 (f32 accumulation); F16
// weights are widened to F32 once at upload and, like F32 weights, run an
// f32 GEMM (CUBLAS_COMPUTE_32F, no TF32).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "worker/cuda/device_buffers.h"

namespace logprob::cuda {

/// The lm_head slice in device memory and its GEMM. Not thread-safe.
class CublasLtLmHead {
 public:
  /// Uploads `weight` ([rows, hidden_size] row-major host bytes of `dtype`
  /// F32, BF16 or F16, the checkpoint layout) once, on the current device.
  /// INVALID_ARGUMENT for a bad dtype, shape or size; INTERNAL for CUDA or
  /// cuBLASLt failures (e.g. out of memory).
  static absl::StatusOr<std::unique_ptr<CublasLtLmHead>> Create(DType dtype, const void* weight, size_t weight_bytes,
                                                                int64_t rows, int64_t hidden_size);
  ~CublasLtLmHead();

  int64_t rows() const { return rows_; }                  // N
  int64_t hidden_size() const { return hidden_size_; }    // H
  DType compute_dtype() const { return compute_dtype_; }  // BF16 or F32
  size_t weight_bytes() const { return weight_.size(); }

  /// logits[M, rows()] (device, f32, row-major) = hidden[M, H] @ W^T with
  /// `hidden` on the device in compute_dtype(), starting 256-byte aligned or
  /// a multiple of 16 rows after such a start; `logits` 256-byte aligned.
  /// Asynchronous on `stream`.
  /// INTERNAL when cuBLASLt finds no algorithm or fails.
  absl::Status Compute(const void* hidden, int64_t M, float* logits, cudaStream_t stream);

 private:
  struct Plan;  // layouts and algorithm for one M
  CublasLtLmHead() = default;
  DType compute_dtype_ = v1::BF16;
  int64_t rows_ = 0, hidden_size_ = 0;
  DeviceBuffer weight_, workspace_;
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_layout_ = nullptr;
  std::map<int64_t, std::unique_ptr<Plan>> plans_;
};

}  // namespace logprob::cuda
