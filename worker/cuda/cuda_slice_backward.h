// The GPU's SliceBackward (worker/scoring/slice_backward.h), the device
// twin of CpuSliceBackward: per round, the hidden rows are uploaded and
// converted as the forward converts them, the slice's cuBLASLt GEMM and
// transform recompute the logits (the forward's algorithm, so its bits),
// the forward's row kernel writes their partial records (only those come
// back to the host); then, with the whole vocabulary's lse and entropy,
// a kernel turns the logits into dL/dy in place (float64 per element, as
// kernels::LogitGradients) and float32 cuBLASLt GEMMs (CUBLAS_COMPUTE_32F,
// no TF32; one algorithm for every row count: lt_f32_matmul.h) give
//   dL/dh = dL/dy W      in tiles of vocabulary columns summed in order
//                        (bf16 weights widened to f32 a tile at a time),
//   dL/dW += dL/dy^T h   and dL/db += column sums of dL/dy, summed on the
//                        device over the item's rounds; Flush adds them to
//                        the step's host sums once per item.
// Everything runs on the backend's compute stream under its stream lock
// (CudaBackend::RunOnComputeStream): the lm_head GEMM's cuBLASLt
// workspace is never shared with a forward.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/device_buffers.h"
#include "worker/cuda/lt_f32_matmul.h"
#include "worker/scoring/slice_backward.h"

namespace logprob::cuda {

/// One work item's backward over a CudaLmHead slice. Device memory, held
/// until destroyed: a round's hidden rows (raw, as GEMM operands and as
/// f32), its logits (m x logits_stride() f32, which become dL/dy), dL/dh
/// (m x H f32), a widened weight tile (bf16 heads: at most 64 MiB), the
/// cuBLASLt workspace (32 MiB) and, with weight gradients, the item's
/// dL/dW and dL/db (logits_stride() x (H + 1) f32). Not thread-safe.
class CudaSliceBackward final : public SliceBackward {
 public:
  /// `backend` and `head` outlive this; `tile_columns`: vocabulary
  /// columns per dL/dh tile, a multiple of 64 (0: TileColumns(H); tests
  /// force several tiles on small heads). INVALID_ARGUMENT for a bad
  /// temperature or tile; INTERNAL when cuBLASLt fails.
  static absl::StatusOr<std::unique_ptr<CudaSliceBackward>> Create(CudaBackend* backend, const CudaLmHead& head,
                                                                   int64_t vocab_begin, float temperature,
                                                                   int64_t tile_columns = 0);
  ~CudaSliceBackward() override;

  int64_t rows() const override { return gemm_.rows(); }
  int64_t hidden_size() const override { return gemm_.hidden_size(); }
  int64_t vocab_begin() const override { return vocab_begin_; }
  float temperature() const override { return temperature_; }
  absl::Status Records(DType hidden_dtype, const void* hidden, int64_t m, const int64_t* targets,
                       const kernels::StatsSpec& spec, uint32_t* records) override;
  absl::Status Gradients(const kernels::BackwardRows& rows, float* grad_hidden, float* grad_weight,
                         float* grad_bias) override;
  /// Downloads the item's device sums in pieces of at most 64 MiB and adds
  /// them to grad_weight / grad_bias; the device sums start again at 0.
  absl::Status Flush(float* grad_weight, float* grad_bias) override;

  /// Vocabulary columns per dL/dh tile for hidden size H: 64 MiB of f32
  /// weights, a multiple of 64 (256-byte aligned tiles), at least 64.
  static int64_t TileColumns(int64_t H);

 private:
  CudaSliceBackward(CudaBackend* backend, const CudaLmHead& head, int64_t vocab_begin, float temperature);
  /// The dL/dh matmul of a tile of k columns (made on first use).
  absl::StatusOr<LtF32Matmul*> DhMatmul(int64_t k);
  /// The dL/dW matmul of a round of m rows (made on first use).
  absl::StatusOr<LtF32Matmul*> DwMatmul(int64_t m);
  /// The round's queued work (RunOnComputeStream's callbacks).
  absl::Status QueueRecords(cudaStream_t s, DType hidden_dtype, const void* hidden, int64_t m, const int64_t* targets,
                            const kernels::StatsSpec& spec, uint32_t* records);
  absl::Status QueueGradients(cudaStream_t s, int64_t m, const kernels::BackwardRows& rows, float* grad_hidden,
                              bool weight_gradients, bool bias_gradient);

  CudaBackend* backend_;
  CublasLtLmHead& gemm_;
  const int device_;
  const int64_t vocab_begin_;
  const float temperature_;
  int64_t tile_columns_ = 64;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_, hidden_raw_, hidden_op_, hidden_f32_, logits_, targets_, row_values_, records_, dh_,
      weight_tile_, dw_, db_;
  std::map<int64_t, std::unique_ptr<LtF32Matmul>> dh_matmuls_, dw_matmuls_;
  DType hidden_dtype_ = v1::F32;
  const void* hidden_op_ptr_ = nullptr;  // the last round's rows as GEMM operands (device)
  int64_t m_ = -1;                       // the last Records' rows; -1: none
  bool sums_ = false;                    // dw_ / db_ hold sums not yet flushed
};

}  // namespace logprob::cuda
