#include "worker/cuda/cuda_backend.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {
namespace {

ElemType ElemOf(DType d) { return d == v1::BF16 ? ElemType::kBF16 : d == v1::F16 ? ElemType::kF16 : ElemType::kF32; }

/// The kernel arguments shared by every sub-block of a call.
RowBlockArgs BaseArgs(const kernels::StatsSpec& spec) {
  RowBlockArgs a;
  a.temperature = spec.temperature;
  a.entropy = spec.entropy ? 1 : 0;
  a.topk = spec.topk;
  a.gather_k = spec.gather_k;
  return a;
}

/// The records of rows over an empty vocabulary slice (fewer vocabulary
/// entries than workers), as the CPU kernel writes them: nothing seen yet.
void EmptySliceRecords(const BlockRows& rows, int64_t vocab_begin, const kernels::StatsSpec& spec, uint32_t* records) {
  std::vector<float> scratch(kernels::kPartialScratchFloats);
  const size_t words = kernels::PartialWords(spec);
  for (int64_t i = 0; i < rows.count; ++i) {
    kernels::SliceRow row;
    row.target = rows.targets[i];
    row.gather_ids = rows.gather_ids ? rows.gather_ids + i * spec.gather_k : nullptr;
    kernels::ComputePartial(v1::F32, row, vocab_begin, 0, spec, records + i * words, scratch.data());
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device, const LmHeadSlice* lm_head,
                                                                 const Options& options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
    return absl::FailedPreconditionError("--backend cuda: no usable CUDA device (cudaGetDeviceCount found none)");
  if (device < 0 || device >= n)
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " does not exist (", n, " device(s))"));
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->device_ = device;
  b->options_ = options;
  b->options_.staging_bytes = std::max<size_t>(b->options_.staging_bytes, 1);
  LOGPROB_RETURN_IF_ERROR(b->compute_.Create());
  LOGPROB_RETURN_IF_ERROR(b->copy_.Create());
  for (int i = 0; i < 2; ++i) {
    LOGPROB_RETURN_IF_ERROR(b->copied_[i].Create());
    LOGPROB_RETURN_IF_ERROR(b->computed_[i].Create());
  }
  if (lm_head) {
    // The GEMM's one algorithm (every M runs it) is chosen for the usual
    // chunk: GemmChunkRows's gemm_chunk_bytes / 4N rows, 16 to 4096.
    const int64_t chunk_rows =
        std::clamp<int64_t>(static_cast<int64_t>(b->options_.gemm_chunk_bytes /
                                                 (static_cast<size_t>(std::max<int64_t>(lm_head->rows, 1)) * 4)),
                            16, 4096);
    LOGPROB_ASSIGN_OR_RETURN(
        b->gemm_, CublasLtLmHead::Create(lm_head->dtype, lm_head->weight.data(), lm_head->weight.size(), lm_head->rows,
                                         lm_head->hidden_size, options.lm_head_precision, chunk_rows));
  }
  return b;
}

absl::Status CudaBackend::UploadIds(const BlockRows& rows, const kernels::StatsSpec& spec) {
  const size_t n = static_cast<size_t>(rows.count);
  LOGPROB_RETURN_IF_ERROR(targets_dev_.Reserve(n * 8));
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(targets_dev_.get(), rows.targets, n * 8, cudaMemcpyHostToDevice, compute_.get()), "targets");
  if (spec.gather_k > 0) {
    const size_t bytes = n * static_cast<size_t>(spec.gather_k) * 8;
    LOGPROB_RETURN_IF_ERROR(gather_dev_.Reserve(bytes));
    LOGPROB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(gather_dev_.get(), rows.gather_ids, bytes, cudaMemcpyHostToDevice, compute_.get()),
        "gather ids");
  }
  const size_t words = kernels::PartialWords(spec);
  LOGPROB_RETURN_IF_ERROR(records_dev_.Reserve(n * words * 4));
  if (spec.topk > 0) {
    LOGPROB_RETURN_IF_ERROR(topk_x_dev_.Reserve(n * spec.topk * 4));
    LOGPROB_RETURN_IF_ERROR(topk_id_dev_.Reserve(n * spec.topk * 4));
  }
  return absl::OkStatus();
}

void CudaBackend::PointAtRows(int64_t r0, int64_t n, const kernels::StatsSpec& spec, RowBlockArgs* args) const {
  args->rows = n;
  args->targets = targets_dev_.get<int64_t>() + r0;
  args->gather_ids = spec.gather_k ? gather_dev_.get<int64_t>() + r0 * spec.gather_k : nullptr;
  args->records = records_dev_.get<uint32_t>() + r0 * static_cast<int64_t>(kernels::PartialWords(spec));
  args->topk_scratch_x = spec.topk ? topk_x_dev_.get<float>() + r0 * spec.topk : nullptr;
  args->topk_scratch_id = spec.topk ? topk_id_dev_.get<int32_t>() + r0 * spec.topk : nullptr;
}

absl::Status CudaBackend::FetchRecords(int64_t rows, const kernels::StatsSpec& spec, uint32_t* records) {
  const size_t bytes = static_cast<size_t>(rows) * kernels::PartialWords(spec) * 4;
  LOGPROB_RETURN_IF_ERROR(records_host_.Reserve(bytes));
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(records_host_.get(), records_dev_.get(), bytes, cudaMemcpyDeviceToHost, compute_.get()),
      "records download");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()), "row kernels");
  std::memcpy(records, records_host_.get(), bytes);
  return absl::OkStatus();
}

absl::Status CudaBackend::LogitsPartials(const LogitsBlock& block, const BlockRows& rows,
                                         const kernels::StatsSpec& spec, const SamplingFilter* filter,
                                         uint32_t* records) {
  if (!IsFloatDType(block.dtype)) return absl::InvalidArgumentError("logits dtype must be F32, BF16 or F16");
  if (rows.count <= 0) return absl::OkStatus();
  if (block.len <= 0) {
    EmptySliceRecords(rows, block.vocab_begin, spec, records);
    return absl::OkStatus();
  }
  absl::MutexLock lock(&mu_);
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  const size_t row_bytes = static_cast<size_t>(block.len) * DTypeSize(block.dtype);
  const int64_t sub = std::clamp<int64_t>(static_cast<int64_t>(options_.staging_bytes / row_bytes), 1, rows.count);
  LOGPROB_RETURN_IF_ERROR(UploadIds(rows, spec));
  if (filter) LOGPROB_RETURN_IF_ERROR(keep_min_dev_.Reserve(static_cast<size_t>(rows.count) * 4));
  for (int b = 0; b < 2; ++b) {
    LOGPROB_RETURN_IF_ERROR(staging_host_[b].Reserve(sub * row_bytes));
    LOGPROB_RETURN_IF_ERROR(staging_dev_[b].Reserve(sub * row_bytes));
  }
  RowBlockArgs args = BaseArgs(spec);
  args.type = ElemOf(block.dtype);
  args.row_stride = args.len = block.len;
  args.vocab_begin = block.vocab_begin;
  for (int64_t r0 = 0, i = 0; r0 < rows.count; r0 += sub, ++i) {
    const int64_t n = std::min(sub, rows.count - r0);
    const int b = static_cast<int>(i % 2);
    // Pinned buffer b is free once its previous upload finished; device
    // buffer b once the kernels that read it finished.
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_[b].get()), "staging upload");
    std::memcpy(staging_host_[b].get(), static_cast<const char*>(block.data) + r0 * row_bytes, n * row_bytes);
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_.get(), computed_[b].get(), 0), "wait");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging_dev_[b].get(), staging_host_[b].get(), n * row_bytes,
                                                 cudaMemcpyHostToDevice, copy_.get()),
                                 "logits upload");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied_[b].get(), copy_.get()), "event");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_.get(), copied_[b].get(), 0), "wait");
    args.logits = staging_dev_[b].get();
    PointAtRows(r0, n, spec, &args);
    args.keep_min = nullptr;
    if (filter) {
      FilterArgs f;
      f.logits = args.logits;
      f.type = args.type;
      f.row_stride = f.len = block.len;
      f.rows = n;
      f.temperature = spec.temperature;
      f.top_k = filter->top_k;
      f.top_p = filter->top_p;
      f.keep_min = keep_min_dev_.get<float>() + r0;
      LOGPROB_CUDA_RETURN_IF_ERROR(LaunchSamplingKeepMin(f, compute_.get()), "sampling filter kernel");
      args.keep_min = f.keep_min;
    }
    LOGPROB_CUDA_RETURN_IF_ERROR(LaunchRowPartials(args, compute_.get()), "row partials kernel");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(computed_[b].get(), compute_.get()), "event");
  }
  return FetchRecords(rows.count, spec, records);
}

absl::Status CudaBackend::SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                        uint32_t* records) {
  return LogitsPartials(block, rows, spec, nullptr, records);
}

absl::Status CudaBackend::FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows,
                                              const kernels::StatsSpec& spec, const SamplingFilter& filter,
                                              uint32_t* records) {
  return LogitsPartials(block, rows, spec, &filter, records);
}

absl::StatusOr<const void*> CudaBackend::UploadHidden(DType hidden_dtype, const void* hidden, int64_t M) {
  if (!IsFloatDType(hidden_dtype))
    return absl::InvalidArgumentError(
        absl::StrCat("hidden states dtype must be F32, BF16 or F16, got ", DTypeName(hidden_dtype)));
  const size_t n = static_cast<size_t>(M * gemm_->hidden_size()), bytes = n * DTypeSize(hidden_dtype);
  LOGPROB_RETURN_IF_ERROR(staging_host_[0].Reserve(bytes));
  LOGPROB_RETURN_IF_ERROR(hidden_raw_.Reserve(bytes));
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_[0].get()), "staging upload");
  std::memcpy(staging_host_[0].get(), hidden, bytes);
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(hidden_raw_.get(), staging_host_[0].get(), bytes, cudaMemcpyHostToDevice, compute_.get()),
      "hidden states upload");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied_[0].get(), compute_.get()), "event");
  if (hidden_dtype == gemm_->compute_dtype()) return static_cast<const void*>(hidden_raw_.get());
  LOGPROB_RETURN_IF_ERROR(hidden_dev_.Reserve(n * DTypeSize(gemm_->compute_dtype())));
  LOGPROB_CUDA_RETURN_IF_ERROR(LaunchConvert(hidden_raw_.get(), ElemOf(hidden_dtype), static_cast<int64_t>(n),
                                             hidden_dev_.get(), ElemOf(gemm_->compute_dtype()), compute_.get()),
                               "hidden states conversion");
  return static_cast<const void*>(hidden_dev_.get());
}

int64_t CudaBackend::GemmChunkRows(int64_t M) const {
  const int64_t by_bytes = static_cast<int64_t>(options_.gemm_chunk_bytes / (static_cast<size_t>(gemm_->rows()) * 4));
  int64_t g = std::max<int64_t>(16, by_bytes);
  if (g < M) g -= g % 16;
  return std::min(g, M);
}

absl::Status CudaBackend::HiddenPartials(DType hidden_dtype, const void* hidden, int64_t vocab_begin,
                                         const BlockRows& rows, const kernels::StatsSpec& spec, uint32_t* records) {
  if (!gemm_) return NoLmHeadError();
  if (rows.count <= 0) return absl::OkStatus();
  if (lm_head_rows() <= 0) {
    EmptySliceRecords(rows, vocab_begin, spec, records);
    return absl::OkStatus();
  }
  absl::MutexLock lock(&mu_);
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  LOGPROB_ASSIGN_OR_RETURN(const void* dev_hidden, UploadHidden(hidden_dtype, hidden, rows.count));
  LOGPROB_RETURN_IF_ERROR(UploadIds(rows, spec));
  const int64_t N = gemm_->rows(), H = gemm_->hidden_size(), G = GemmChunkRows(rows.count);
  LOGPROB_RETURN_IF_ERROR(logits_dev_.Reserve(static_cast<size_t>(G * N) * 4));
  const size_t csize = DTypeSize(gemm_->compute_dtype());
  RowBlockArgs args = BaseArgs(spec);
  args.logits = logits_dev_.get();
  args.type = ElemType::kF32;
  args.row_stride = args.len = N;
  args.vocab_begin = vocab_begin;
  for (int64_t r0 = 0; r0 < rows.count; r0 += G) {
    const int64_t n = std::min(G, rows.count - r0);
    // The chunk's logits are consumed by the statistics kernel right after
    // the GEMM on the same stream, then overwritten by the next chunk.
    LOGPROB_RETURN_IF_ERROR(gemm_->Compute(static_cast<const char*>(dev_hidden) + r0 * H * csize, n,
                                           logits_dev_.get<float>(), compute_.get()));
    PointAtRows(r0, n, spec, &args);
    LOGPROB_CUDA_RETURN_IF_ERROR(LaunchRowPartials(args, compute_.get()), "row partials kernel");
  }
  return FetchRecords(rows.count, spec, records);
}

absl::Status CudaBackend::HiddenLogits(DType hidden_dtype, const void* hidden, int64_t M, float* logits) {
  if (!gemm_) return NoLmHeadError();
  if (M <= 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  LOGPROB_ASSIGN_OR_RETURN(const void* dev_hidden, UploadHidden(hidden_dtype, hidden, M));
  const int64_t N = gemm_->rows(), H = gemm_->hidden_size(), G = GemmChunkRows(M);
  LOGPROB_RETURN_IF_ERROR(logits_dev_.Reserve(static_cast<size_t>(G * N) * 4));
  const size_t csize = DTypeSize(gemm_->compute_dtype());
  for (int64_t r0 = 0; r0 < M; r0 += G) {
    const int64_t n = std::min(G, M - r0);
    LOGPROB_RETURN_IF_ERROR(gemm_->Compute(static_cast<const char*>(dev_hidden) + r0 * H * csize, n,
                                           logits_dev_.get<float>(), compute_.get()));
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits + r0 * N, logits_dev_.get(), static_cast<size_t>(n * N) * 4,
                                                 cudaMemcpyDeviceToHost, compute_.get()),
                                 "logits download");
  }
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()), "lm_head GEMM");
  return absl::OkStatus();
}

int64_t CudaBackend::device_memory_bytes() const {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
  return static_cast<int64_t>(total_bytes - free_bytes);
}

}  // namespace logprob::cuda
