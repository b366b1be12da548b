#include "worker/cuda/cuda_slice_backward.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/lm_head_precision.h"
#include "common/status_macros.h"
#include "worker/cuda/backward_kernels.h"
#include "worker/cuda/elem_type.h"
#include "worker/cuda/lt_algo.h"
#include "worker/cuda/row_kernels.h"
#include "worker/cuda/select_device.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
/// Bytes of f32 weights per dL/dh tile, and of sums per Flush piece.
constexpr size_t kTileBytes = size_t{64} << 20;

}  // namespace

int64_t CudaSliceBackward::TileColumns(int64_t H) {
  const int64_t cols = static_cast<int64_t>(kTileBytes / (static_cast<size_t>(std::max<int64_t>(H, 1)) * 4));
  return std::max<int64_t>(64, cols / 64 * 64);
}

CudaSliceBackward::CudaSliceBackward(CudaBackend* backend, const CudaLmHead& head, int64_t vocab_begin,
                                     float temperature)
    : backend_(backend),
      gemm_(head.gemm()),
      device_(head.device()),
      vocab_begin_(vocab_begin),
      temperature_(temperature) {}

CudaSliceBackward::~CudaSliceBackward() {
  // The device buffers and cuBLASLt objects go with this device current.
  SelectDevice(device_);
  dh_matmuls_.clear();
  dw_matmuls_.clear();
  if (handle_) cublasLtDestroy(handle_);
}

absl::StatusOr<std::unique_ptr<CudaSliceBackward>> CudaSliceBackward::Create(CudaBackend* backend,
                                                                             const CudaLmHead& head,
                                                                             int64_t vocab_begin, float temperature,
                                                                             int64_t tile_columns) {
  if (!(temperature > 0.0f))
    return absl::InvalidArgumentError(absl::StrCat("temperature must be > 0, got ", temperature));
  if (tile_columns < 0 || tile_columns % 64 != 0)
    return absl::InvalidArgumentError(absl::StrCat("tile_columns must be a multiple of 64, got ", tile_columns));
  std::unique_ptr<CudaSliceBackward> b(new CudaSliceBackward(backend, head, vocab_begin, temperature));
  b->tile_columns_ = tile_columns > 0 ? tile_columns : TileColumns(head.hidden_size());
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(b->device_), "cudaSetDevice");
  LOGPROB_RETURN_IF_ERROR(LtStatus(cublasLtCreate(&b->handle_), "create"));
  LOGPROB_RETURN_IF_ERROR(b->workspace_.Reserve(kWorkspaceBytes));
  return b;
}

absl::StatusOr<LtF32Matmul*> CudaSliceBackward::DhMatmul(int64_t k) {
  auto& mm = dh_matmuls_[k];
  if (!mm) {
    // Column-major dh^T [H, m] = W_tile^T [H, k] x dy_tile^T [k, m]: W's
    // rows (ld H) and dL/dy's rows (ld logits_stride()) as stored.
    LtF32Matmul::Shape s;
    s.m = hidden_size();
    s.k = k;
    s.lda = hidden_size();
    s.ldb = gemm_.logits_stride();
    s.ldd = hidden_size();
    s.ref_n = CublasLtLmHead::kDefaultAlgoRows;
    s.b_align = 256;  // tiles start at multiples of 64 columns
    LOGPROB_ASSIGN_OR_RETURN(mm, LtF32Matmul::Create(handle_, s, kWorkspaceBytes, "lm_head backward dL/dh",
                                                     /*log_choice=*/false));
  }
  return mm.get();
}

absl::StatusOr<LtF32Matmul*> CudaSliceBackward::DwMatmul(int64_t m) {
  if (dw_matmuls_.size() > 64 && dw_matmuls_.count(m) == 0) dw_matmuls_.clear();  // bounded: rounds vary little
  auto& mm = dw_matmuls_[m];
  if (!mm) {
    // Column-major dW^T [H, S] += h^T [H, m] x dy [m, S] (dL/dy's rows
    // transposed): the sum over the round's rows; row counts vary, the
    // slice does not.
    LtF32Matmul::Shape s;
    s.trans_b = true;
    s.m = hidden_size();
    s.k = m;
    s.lda = hidden_size();
    s.ldb = gemm_.logits_stride();
    s.ldd = hidden_size();
    s.ref_n = gemm_.logits_stride();
    s.b_align = 256;
    LOGPROB_ASSIGN_OR_RETURN(mm, LtF32Matmul::Create(handle_, s, kWorkspaceBytes, "lm_head backward dL/dW",
                                                     /*log_choice=*/false));
  }
  return mm.get();
}

absl::Status CudaSliceBackward::Records(DType hidden_dtype, const void* hidden, int64_t m, const int64_t* targets,
                                        const kernels::StatsSpec& spec, uint32_t* records) {
  m_ = -1;
  LOGPROB_RETURN_IF_ERROR(CheckRecordsCall(hidden_dtype, hidden, m, spec, records));
  if (m > 0) {
    LOGPROB_RETURN_IF_ERROR(backend_->RunOnComputeStream(
        [&](cudaStream_t s) { return QueueRecords(s, hidden_dtype, hidden, m, targets, spec, records); }));
  }
  hidden_dtype_ = hidden_dtype;
  m_ = m;
  return absl::OkStatus();
}

absl::Status CudaSliceBackward::QueueRecords(cudaStream_t s, DType hidden_dtype, const void* hidden, int64_t m,
                                             const int64_t* targets, const kernels::StatsSpec& spec,
                                             uint32_t* records) {
  const int64_t H = hidden_size(), S = gemm_.logits_stride();
  const DType compute = gemm_.compute_dtype();
  const size_t raw_bytes = static_cast<size_t>(m * H) * DTypeSize(hidden_dtype);
  const size_t record_bytes = static_cast<size_t>(m) * kernels::PartialWords(spec) * sizeof(uint32_t);
  LOGPROB_RETURN_IF_ERROR(hidden_raw_.Reserve(raw_bytes));
  LOGPROB_RETURN_IF_ERROR(logits_.Reserve(static_cast<size_t>(m * S) * sizeof(float)));
  LOGPROB_RETURN_IF_ERROR(targets_.Reserve(static_cast<size_t>(m) * sizeof(int64_t)));
  LOGPROB_RETURN_IF_ERROR(records_.Reserve(record_bytes));
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(hidden_raw_.get(), hidden, raw_bytes, cudaMemcpyHostToDevice, s),
                               "hidden states upload");
  // The GEMM's operands, converted on the device as the forward converts them.
  const void* op = hidden_raw_.get();
  if (hidden_dtype != compute) {
    LOGPROB_RETURN_IF_ERROR(hidden_op_.Reserve(static_cast<size_t>(m * H) * DTypeSize(compute)));
    LOGPROB_CUDA_RETURN_IF_ERROR(
        LaunchConvert(hidden_raw_.get(), ElemTypeOf(hidden_dtype), m * H, hidden_op_.get(), ElemTypeOf(compute), s),
        "hidden states conversion");
    op = hidden_op_.get();
  }
  LOGPROB_RETURN_IF_ERROR(gemm_.Compute(op, m, logits_.get<float>(), s));
  std::vector<int64_t> ids(static_cast<size_t>(m), -1);
  if (targets != nullptr) std::copy(targets, targets + m, ids.begin());
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(targets_.get(), ids.data(), ids.size() * sizeof(int64_t), cudaMemcpyHostToDevice, s),
      "targets upload");
  RowBlockArgs args = RowArgsOf(spec);
  args.logits = logits_.get();
  args.type = ElemType::kF32;
  args.row_stride = S;
  args.len = rows();
  args.vocab_begin = vocab_begin_;
  args.rows = m;
  args.targets = targets_.get<int64_t>();
  args.records = records_.get<uint32_t>();
  LOGPROB_CUDA_RETURN_IF_ERROR(LaunchRowPartials(args, s), "row partials kernel");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(records, records_.get(), record_bytes, cudaMemcpyDeviceToHost, s),
                               "records download");
  // Synchronised before `ids` goes (a pageable upload may still read it).
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "backward records");
  hidden_op_ptr_ = op;
  return absl::OkStatus();
}

absl::Status CudaSliceBackward::Gradients(const kernels::BackwardRows& rows_in, float* grad_hidden, float* grad_weight,
                                          float* grad_bias) {
  if (m_ < 0) return absl::FailedPreconditionError("backward gradients without the round's records");
  const int64_t m = m_;
  m_ = -1;  // the logits become dL/dy
  if (m == 0) return absl::OkStatus();
  if (grad_hidden == nullptr || rows_in.lse == nullptr) return absl::InvalidArgumentError("null lse or dL/dh buffer");
  if (rows_in.grad_entropy != nullptr && rows_in.entropy == nullptr)
    return absl::InvalidArgumentError("an entropy gradient needs the forward's entropy");
  return backend_->RunOnComputeStream([&](cudaStream_t s) {
    return QueueGradients(s, m, rows_in, grad_hidden, grad_weight != nullptr, grad_bias != nullptr);
  });
}

absl::Status CudaSliceBackward::QueueGradients(cudaStream_t s, int64_t m, const kernels::BackwardRows& rows_in,
                                               float* grad_hidden, bool weight_gradients, bool bias_gradient) {
  const int64_t H = hidden_size(), S = gemm_.logits_stride(), V = rows();
  const DType compute = gemm_.compute_dtype();
  // The rows' values: lse, entropy, dL/dlogprob, dL/dentropy ([m] each).
  std::vector<float> values(static_cast<size_t>(4 * m), 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    values[i] = rows_in.lse[i];
    if (rows_in.entropy) values[m + i] = rows_in.entropy[i];
    if (rows_in.grad_logprobs) values[2 * m + i] = rows_in.grad_logprobs[i];
    if (rows_in.grad_entropy) values[3 * m + i] = rows_in.grad_entropy[i];
  }
  // The rows' targets as Gradients got them (Records' were the same rows').
  std::vector<int64_t> ids(static_cast<size_t>(m), -1);
  if (rows_in.targets != nullptr) std::copy(rows_in.targets, rows_in.targets + m, ids.begin());
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(targets_.get(), ids.data(), ids.size() * sizeof(int64_t), cudaMemcpyHostToDevice, s),
      "targets upload");
  LOGPROB_RETURN_IF_ERROR(row_values_.Reserve(values.size() * sizeof(float)));
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(row_values_.get(), values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice, s),
      "backward rows upload");
  const float* rv = row_values_.get<float>();
  LogitGradArgs a;
  a.logits = logits_.get<float>();
  a.rows = m;
  a.len = V;
  a.row_stride = S;
  a.vocab_begin = vocab_begin_;
  a.targets = targets_.get<int64_t>();
  a.lse = rv;
  a.entropy = rows_in.entropy ? rv + m : nullptr;
  a.grad_logprobs = rows_in.grad_logprobs ? rv + 2 * m : nullptr;
  a.grad_entropy = rows_in.grad_entropy ? rv + 3 * m : nullptr;
  a.temperature = temperature_;
  a.scale = static_cast<float>(gemm_.transform().logit_scale);
  a.softcap = static_cast<float>(gemm_.transform().softcap);
  LOGPROB_CUDA_RETURN_IF_ERROR(LaunchLogitGradients(a, s), "logit gradients kernel");

  // dL/dh: the vocabulary tiles in order, each adding to the last.
  LOGPROB_RETURN_IF_ERROR(dh_.Reserve(static_cast<size_t>(m * H) * sizeof(float)));
  const int64_t T = tile_columns_;
  const bool tf32 = gemm_.precision() == LmHeadPrecision::kTf32;
  for (int64_t v0 = 0; v0 < S; v0 += T) {
    const int64_t k = std::min(T, S - v0);
    const float* w = nullptr;
    if (compute == v1::F32 && !tf32) {
      w = static_cast<const float*>(gemm_.weight()) + v0 * H;
    } else if (tf32) {
      // The forward's tf32 operands, as the CPU's backward takes them
      // (RoundToTf32 of the f32 weights, into the tile buffer).
      LOGPROB_RETURN_IF_ERROR(weight_tile_.Reserve(static_cast<size_t>(T * H) * sizeof(float)));
      LOGPROB_CUDA_RETURN_IF_ERROR(
          LaunchRoundToTf32(static_cast<const float*>(gemm_.weight()) + v0 * H, k * H, weight_tile_.get<float>(), s),
          "weight tile rounding");
      w = weight_tile_.get<float>();
    } else {
      // bf16 weights widened (exactly) a tile at a time; the previous
      // tile's matmul, queued before on this stream, has read the buffer.
      LOGPROB_RETURN_IF_ERROR(weight_tile_.Reserve(static_cast<size_t>(T * H) * sizeof(float)));
      LOGPROB_CUDA_RETURN_IF_ERROR(
          LaunchConvert(static_cast<const char*>(gemm_.weight()) + static_cast<size_t>(v0 * H) * DTypeSize(compute),
                        ElemTypeOf(compute), k * H, weight_tile_.get(), ElemType::kF32, s),
          "weight tile conversion");
      w = weight_tile_.get<float>();
    }
    LOGPROB_ASSIGN_OR_RETURN(LtF32Matmul * mm, DhMatmul(k));
    LOGPROB_RETURN_IF_ERROR(
        mm->Run(w, logits_.get<float>() + v0, dh_.get<float>(), m, v0 == 0 ? 0.0f : 1.0f, workspace_.get(), s));
  }
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(grad_hidden, dh_.get(), static_cast<size_t>(m * H) * sizeof(float), cudaMemcpyDeviceToHost, s),
      "dL/dh download");
  if (weight_gradients) {
    if (!sums_) {
      LOGPROB_RETURN_IF_ERROR(dw_.Reserve(static_cast<size_t>(S * H) * sizeof(float)));
      LOGPROB_RETURN_IF_ERROR(db_.Reserve(static_cast<size_t>(S) * sizeof(float)));
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dw_.get(), 0, static_cast<size_t>(S * H) * sizeof(float), s),
                                   "dL/dW zero fill");
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(db_.get(), 0, static_cast<size_t>(S) * sizeof(float), s),
                                   "dL/db zero fill");
      sums_ = true;
    }
    // dL/dW's operand: the rows as the forward's GEMM saw them, in f32
    // (tf32: rounded as the CPU's backward rounds them).
    const float* h32 = static_cast<const float*>(hidden_op_ptr_);
    if (tf32) {
      LOGPROB_RETURN_IF_ERROR(hidden_f32_.Reserve(static_cast<size_t>(m * H) * sizeof(float)));
      LOGPROB_CUDA_RETURN_IF_ERROR(LaunchRoundToTf32(h32, m * H, hidden_f32_.get<float>(), s),
                                   "hidden states rounding");
      h32 = hidden_f32_.get<float>();
    } else if (compute != v1::F32) {
      LOGPROB_RETURN_IF_ERROR(hidden_f32_.Reserve(static_cast<size_t>(m * H) * sizeof(float)));
      LOGPROB_CUDA_RETURN_IF_ERROR(
          LaunchConvert(hidden_op_ptr_, ElemTypeOf(compute), m * H, hidden_f32_.get(), ElemType::kF32, s),
          "hidden states widening");
      h32 = hidden_f32_.get<float>();
    }
    LOGPROB_ASSIGN_OR_RETURN(LtF32Matmul * mm, DwMatmul(m));
    LOGPROB_RETURN_IF_ERROR(mm->Run(h32, logits_.get<float>(), dw_.get<float>(), S, 1.0f, workspace_.get(), s));
    if (bias_gradient)
      LOGPROB_CUDA_RETURN_IF_ERROR(LaunchColumnSums(logits_.get<float>(), m, V, S, db_.get<float>(), s),
                                   "dL/db kernel");
  }
  // Synchronised before `values` and `ids` go (a pageable upload may still read them).
  return CudaStatus(cudaStreamSynchronize(s), "backward gradients");
}

absl::Status CudaSliceBackward::Flush(float* grad_weight, float* grad_bias) {
  if (!sums_) return absl::OkStatus();
  if (grad_weight == nullptr) {
    sums_ = false;  // the next item's rounds start from 0, whatever this one left
    return absl::InvalidArgumentError("flush: null dL/dW sums");
  }
  const int64_t H = hidden_size(), V = rows();
  const absl::Status st = backend_->RunOnComputeStream([&](cudaStream_t s) -> absl::Status {
    const int64_t piece = std::max<int64_t>(1, static_cast<int64_t>(kTileBytes / (static_cast<size_t>(H) * 4)));
    std::vector<float> host(static_cast<size_t>(std::min(piece, V) * H));
    for (int64_t r0 = 0; r0 < V; r0 += piece) {
      const int64_t n = std::min(piece, V - r0);
      LOGPROB_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(host.data(), dw_.get<float>() + r0 * H, static_cast<size_t>(n * H) * sizeof(float),
                          cudaMemcpyDeviceToHost, s),
          "dL/dW download");
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "dL/dW download");
      float* out = grad_weight + r0 * H;
      for (int64_t k = 0; k < n * H; ++k) out[k] += host[static_cast<size_t>(k)];
    }
    if (grad_bias != nullptr) {
      host.resize(static_cast<size_t>(std::max<int64_t>(V, 1)));
      LOGPROB_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(host.data(), db_.get(), static_cast<size_t>(V) * sizeof(float), cudaMemcpyDeviceToHost, s),
          "dL/db download");
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "dL/db download");
      for (int64_t c = 0; c < V; ++c) grad_bias[c] += host[static_cast<size_t>(c)];
    }
    return absl::OkStatus();
  });
  sums_ = false;
  return st;
}

}  // namespace logprob::cuda
