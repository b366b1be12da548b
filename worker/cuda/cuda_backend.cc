#include "worker/cuda/cuda_backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_ipc.h"
#include "worker/cuda/row_kernels.h"
#include "worker/kernels/lm_head_gemm.h"

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

/// Rows whose f32 logits over N columns fit in `gemm_chunk_bytes`, at least 16.
int64_t RowsInBudget(size_t gemm_chunk_bytes, int64_t N) {
  return std::max<int64_t>(16,
                           static_cast<int64_t>(gemm_chunk_bytes / (static_cast<size_t>(std::max<int64_t>(N, 1)) * 4)));
}

/// x rounded up to a multiple of 16 (rows: GEMM chunks start aligned).
int64_t RoundUp16(int64_t x) { return (x + 15) / 16 * 16; }

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device, const Options& options) {
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
  LOGPROB_RETURN_IF_ERROR(b->stats_.Create());
  for (int i = 0; i < 2; ++i) {
    LOGPROB_RETURN_IF_ERROR(b->copied_[i].Create());
    LOGPROB_RETURN_IF_ERROR(b->computed_[i].Create());
    LOGPROB_RETURN_IF_ERROR(b->gemm_done_[i].Create());
    LOGPROB_RETURN_IF_ERROR(b->stats_done_[i].Create());
  }
  return b;
}

absl::StatusOr<std::shared_ptr<const LmHeadWeights>> CudaBackend::LoadLmHead(LmHeadSlice slice,
                                                                             LmHeadPrecision precision) {
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  // The GEMM's one algorithm (every M runs it) is chosen for the usual
  // chunk (GemmChunkRows), at most 4096 rows.
  const int64_t chunk_rows = std::min<int64_t>(RowsInBudget(options_.gemm_chunk_bytes, slice.rows), 4096);
  LOGPROB_ASSIGN_OR_RETURN(auto gemm, CublasLtLmHead::Create(slice.dtype, slice.weight.data(), slice.weight.size(),
                                                             slice.rows, slice.hidden_size, precision, chunk_rows));
  return std::shared_ptr<const LmHeadWeights>(std::make_shared<CudaLmHead>(std::move(gemm)));
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

absl::Status CudaBackend::Download(const void* src, size_t bytes, void* dst) {
  LOGPROB_RETURN_IF_ERROR(records_host_.Reserve(std::max<size_t>(bytes, 1)));
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(records_host_.get(), src, bytes, cudaMemcpyDeviceToHost, compute_.get()),
                               "records download");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()), "row kernels");
  std::memcpy(dst, records_host_.get(), bytes);
  return absl::OkStatus();
}

absl::Status CudaBackend::FetchRecords(int64_t rows, const kernels::StatsSpec& spec, uint32_t* records) {
  return Download(records_dev_.get(), static_cast<size_t>(rows) * kernels::PartialWords(spec) * 4, records);
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
  // Page-locked logits (a payload region the worker registered) upload
  // straight from where they are; others through the pinned buffers.
  const bool direct = IsPageLocked(block.data, static_cast<size_t>(rows.count) * row_bytes);
  for (int b = 0; b < 2; ++b) {
    if (!direct) LOGPROB_RETURN_IF_ERROR(staging_host_[b].Reserve(sub * row_bytes));
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
    const char* from = static_cast<const char*>(block.data) + r0 * row_bytes;
    if (!direct) {
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_[b].get()), "staging upload");
      std::memcpy(staging_host_[b].get(), from, n * row_bytes);
      from = staging_host_[b].get<char>();
    }
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_.get(), computed_[b].get(), 0), "wait");
    LOGPROB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging_dev_[b].get(), from, n * row_bytes, cudaMemcpyHostToDevice, copy_.get()),
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

int64_t CudaBackend::GemmChunkRows(int64_t M) const {
  int64_t g = RowsInBudget(options_.gemm_chunk_bytes, gemm_->rows());
  if (g < M) g -= g % 16;
  return std::min(g, M);
}

absl::Status CudaBackend::HiddenPartials(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden,
                                         int64_t vocab_begin, const BlockRows& rows, const kernels::StatsSpec& spec,
                                         uint32_t* records) {
  if (rows.count <= 0) return absl::OkStatus();
  if (lm_head.rows() <= 0) {
    EmptySliceRecords(rows, vocab_begin, spec, records);
    return absl::OkStatus();
  }
  LOGPROB_RETURN_IF_ERROR(kernels::CheckHiddenStatesDType(hidden_dtype));
  absl::MutexLock lock(&mu_);
  const UsingLmHead using_head(this, lm_head);
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  LOGPROB_RETURN_IF_ERROR(UploadIds(rows, spec));
  const size_t raw_row = static_cast<size_t>(gemm_->hidden_size()) * DTypeSize(hidden_dtype);
  const int64_t G = GemmChunkRows(RoundUp16(rows.count));
  LOGPROB_RETURN_IF_ERROR(hidden_raw_.Reserve(static_cast<size_t>(rows.count) * raw_row));
  LOGPROB_RETURN_IF_ERROR(UploadRows(static_cast<const char*>(hidden), /*on_device=*/false, rows.count, raw_row, G,
                                     hidden_raw_.get<char>()));
  LOGPROB_RETURN_IF_ERROR(GemmAndStats(hidden_raw_.get<char>(), hidden_dtype, 0, rows.count, G, 0,
                                       /*wait_uploads=*/true, vocab_begin, spec)
                              .status());
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stats_.get()), "row partials kernel");
  return FetchRecords(rows.count, spec, records);
}

absl::Status CudaBackend::HiddenLogits(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t M,
                                       float* logits) {
  if (M <= 0) return absl::OkStatus();
  LOGPROB_RETURN_IF_ERROR(kernels::CheckHiddenStatesDType(hidden_dtype));
  absl::MutexLock lock(&mu_);
  const UsingLmHead using_head(this, lm_head);
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  const int64_t N = gemm_->rows(), G = GemmChunkRows(RoundUp16(M));
  const size_t raw_row = static_cast<size_t>(gemm_->hidden_size()) * DTypeSize(hidden_dtype);
  LOGPROB_RETURN_IF_ERROR(hidden_raw_.Reserve(static_cast<size_t>(M) * raw_row));
  LOGPROB_RETURN_IF_ERROR(
      UploadRows(static_cast<const char*>(hidden), /*on_device=*/false, M, raw_row, G, hidden_raw_.get<char>()));
  LOGPROB_RETURN_IF_ERROR(logits_dev_.Reserve(static_cast<size_t>(G * N) * 4));
  for (int64_t r0 = 0; r0 < M; r0 += G) {
    const int64_t n = std::min(G, M - r0);
    LOGPROB_ASSIGN_OR_RETURN(const void* a,
                             ChunkOperand(hidden_raw_.get<char>(), hidden_dtype, r0, n, G, /*wait_uploads=*/true));
    LOGPROB_RETURN_IF_ERROR(gemm_->Compute(a, n, logits_dev_.get<float>(), compute_.get()));
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits + r0 * N, logits_dev_.get(), static_cast<size_t>(n * N) * 4,
                                                 cudaMemcpyDeviceToHost, compute_.get()),
                                 "logits download");
  }
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()), "lm_head GEMM");
  return absl::OkStatus();
}

namespace {

/// INVALID_ARGUMENT unless `item`'s per-rank rows tile its rows in rank order.
absl::Status CheckItemRows(const HiddenItemRows& item, int W, int me) {
  if (static_cast<int>(item.first.size()) != W || static_cast<int>(item.count.size()) != W)
    return absl::InvalidArgumentError(
        absl::StrCat("hidden-states item: ", item.first.size(), " rank ranges for ", W, " ranks"));
  int64_t next = 0;
  for (int q = 0; q < W; ++q) {
    if (item.first[q] != next || item.count[q] < 0)
      return absl::InvalidArgumentError(absl::StrCat("hidden-states item: rank ", q, "'s rows [", item.first[q], ", +",
                                                     item.count[q], ") do not follow rank ", q - 1, "'s"));
    next += item.count[q];
  }
  if (next != item.rows.count)
    return absl::InvalidArgumentError(
        absl::StrCat("hidden-states item: ranks hold ", next, " rows, targets ", item.rows.count));
  if (item.count[me] > 0 && item.own == nullptr) return absl::InvalidArgumentError("hidden-states item: no rows");
  return kernels::CheckHiddenStatesDType(item.dtype);
}

}  // namespace

void CudaBackend::RegisterHostMemory(const void* data, size_t bytes) {
  if (!data || bytes == 0) return;
  absl::MutexLock lock(&reg_mu_);
  if (registered_.count(static_cast<const char*>(data))) return;
  if (cudaSetDevice(device_) != cudaSuccess) return;
  // Read-only: the worker maps payload regions PROT_READ.
  const cudaError_t e =
      cudaHostRegister(const_cast<void*>(data), bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it
    if (!register_failed_)
      std::fprintf(stderr,
                   "logprob-worker: cudaHostRegister of a %zu-byte payload region failed (%s); uploads "
                   "from it go through the staging buffers\n",
                   bytes, cudaGetErrorString(e));
    register_failed_ = true;
    return;
  }
  registered_[static_cast<const char*>(data)] = bytes;
}

void CudaBackend::UnregisterHostMemory(const void* data) {
  absl::MutexLock lock(&reg_mu_);
  auto it = registered_.find(static_cast<const char*>(data));
  if (it == registered_.end()) return;
  cudaSetDevice(device_);
  cudaHostUnregister(const_cast<char*>(it->first));
  registered_.erase(it);
}

bool CudaBackend::IsPageLocked(const void* data, size_t bytes) const {
  const char* p = static_cast<const char*>(data);
  {
    absl::MutexLock lock(&reg_mu_);
    auto it = registered_.upper_bound(p);
    if (it != registered_.begin()) {
      --it;
      if (p >= it->first && p + bytes <= it->first + it->second) return true;
    }
  }
  // Page-locked by someone else (cudaMallocHost, cudaHostRegister): both
  // ends are host memory the driver knows. A copy from pageable memory
  // would still be correct, only synchronous.
  auto pinned = [](const char* q) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, q) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeHost;
  };
  return bytes > 0 && pinned(p) && pinned(p + bytes - 1);
}

absl::Status CudaBackend::UploadRows(const char* src, bool on_device, int64_t rows, size_t row_bytes,
                                     int64_t chunk_rows, char* dst) {
  const int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
  while (static_cast<int64_t>(uploaded_.size()) < chunks) {
    auto e = std::make_unique<Event>();
    LOGPROB_RETURN_IF_ERROR(e->Create());
    uploaded_.push_back(std::move(e));
  }
  const bool direct = on_device || IsPageLocked(src, static_cast<size_t>(rows) * row_bytes);
  if (!direct)
    for (int b = 0; b < 2; ++b) LOGPROB_RETURN_IF_ERROR(staging_host_[b].Reserve(chunk_rows * row_bytes));
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t r0 = c * chunk_rows, n = std::min(chunk_rows, rows - r0);
    const size_t bytes = static_cast<size_t>(n) * row_bytes, at = static_cast<size_t>(r0) * row_bytes;
    if (direct) {
      LOGPROB_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst + at, src + at, bytes, on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice,
                          copy_.get()),
          "hidden states upload");
    } else {
      // Pageable memory: copy into pinned buffer b (free once its previous
      // upload finished) while earlier chunks upload and multiply.
      const int b = static_cast<int>(c % 2);
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_[b].get()), "staging upload");
      std::memcpy(staging_host_[b].get(), src + at, bytes);
      LOGPROB_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst + at, staging_host_[b].get(), bytes, cudaMemcpyHostToDevice, copy_.get()),
          "hidden states upload");
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied_[b].get(), copy_.get()), "event");
    }
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(uploaded_[c]->get(), copy_.get()), "event");
  }
  return absl::OkStatus();
}

absl::StatusOr<const void*> CudaBackend::ChunkOperand(const char* hidden, DType dtype, int64_t l0, int64_t n, int64_t G,
                                                      bool wait_uploads) {
  if (wait_uploads)
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_.get(), uploaded_[l0 / G]->get(), 0), "wait");
  const int64_t H = gemm_->hidden_size();
  const void* a = hidden + static_cast<size_t>(l0 * H) * DTypeSize(dtype);
  if (dtype == gemm_->compute_dtype()) return a;
  // hidden_dev_ holds one chunk: the previous chunk's GEMM, queued before
  // on this stream, has read it.
  LOGPROB_RETURN_IF_ERROR(hidden_dev_.Reserve(static_cast<size_t>(G * H) * DTypeSize(gemm_->compute_dtype())));
  LOGPROB_CUDA_RETURN_IF_ERROR(
      LaunchConvert(a, ElemOf(dtype), n * H, hidden_dev_.get(), ElemOf(gemm_->compute_dtype()), compute_.get()),
      "hidden states conversion");
  return static_cast<const void*>(hidden_dev_.get());
}

absl::StatusOr<int64_t> CudaBackend::GemmAndStats(const char* hidden, DType dtype, int64_t row0, int64_t rows,
                                                  int64_t G, int64_t k0, bool wait_uploads, int64_t vocab_begin,
                                                  const kernels::StatsSpec& spec) {
  const int64_t N = gemm_->rows();
  for (int b = 0; b < 2; ++b) LOGPROB_RETURN_IF_ERROR(chunk_logits_[b].Reserve(static_cast<size_t>(G * N) * 4));
  RowBlockArgs args = BaseArgs(spec);
  args.type = ElemType::kF32;
  args.row_stride = args.len = N;
  args.vocab_begin = vocab_begin;
  int64_t k = k0;
  for (int64_t l0 = 0; l0 < rows; l0 += G, ++k) {
    const int64_t n = std::min(G, rows - l0);
    const int b = static_cast<int>(k % 2);
    LOGPROB_ASSIGN_OR_RETURN(const void* a, ChunkOperand(hidden, dtype, l0, n, G, wait_uploads));
    // Logits buffer b is free once the statistics of chunk k - 2 read it.
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_.get(), stats_done_[b].get(), 0), "wait");
    LOGPROB_RETURN_IF_ERROR(gemm_->Compute(a, n, chunk_logits_[b].get<float>(), compute_.get()));
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(gemm_done_[b].get(), compute_.get()), "event");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stats_.get(), gemm_done_[b].get(), 0), "wait");
    args.logits = chunk_logits_[b].get();
    PointAtRows(row0 + l0, n, spec, &args);
    LOGPROB_CUDA_RETURN_IF_ERROR(LaunchRowPartials(args, stats_.get()), "row partials kernel");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(stats_done_[b].get(), stats_.get()), "event");
  }
  return k;
}

absl::Status CudaBackend::HiddenItemPartials(const LmHeadWeights& lm_head, const HiddenItemRows& item,
                                             Communicator& comm, const kernels::StatsSpec& spec,
                                             uint32_t* own_records) {
  if (!OnePassHidden(comm))
    return absl::UnimplementedError("hidden states in one pass need W == 1 or device collectives (NCCL)");
  const int W = comm.size(), me = comm.rank();
  LOGPROB_RETURN_IF_ERROR(CheckItemRows(item, W, me));
  const int64_t n = item.rows.count, mine = item.count[me];
  if (n == 0) return absl::OkStatus();
  const int64_t H = lm_head.hidden_size();
  const size_t raw_row = static_cast<size_t>(H) * DTypeSize(item.dtype), words = kernels::PartialWords(spec);
  // Every rank's rows sit in a slot of `slot` rows (the largest share,
  // rounded to 16 rows so each slot and GEMM chunk is aligned as the GEMM
  // wants); the all-gather fills the slots in place.
  int64_t most = 0;
  for (int64_t c : item.count) most = std::max(most, c);
  const int64_t slot = RoundUp16(std::max<int64_t>(most, 1));
  absl::MutexLock lock(&mu_);
  const UsingLmHead using_head(this, lm_head);
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  // Whatever the exit, no copy still reads `item.own` (a client's CUDA IPC
  // allocation is unmapped once this returns).
  absl::Cleanup uploads_done = [this] { cudaStreamSynchronize(copy_.get()); };
  LOGPROB_RETURN_IF_ERROR(UploadIds(item.rows, spec));
  LOGPROB_RETURN_IF_ERROR(hidden_raw_.Reserve(static_cast<size_t>(W * slot) * raw_row));
  char* slots = hidden_raw_.get<char>();
  const int64_t G = GemmChunkRows(slot);
  LOGPROB_RETURN_IF_ERROR(UploadRows(static_cast<const char*>(item.own), item.own_on_device, mine, raw_row, G,
                                     slots + static_cast<size_t>(me * slot) * raw_row));
  if (W > 1) {
    // The uploads are done before NCCL reads the slot, whichever stream
    // the communicator runs on; AllGatherDevice returns once it finished.
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(copy_.get()), "hidden states upload");
    LOGPROB_RETURN_IF_ERROR(comm.AllGatherDevice(slots + static_cast<size_t>(me * slot) * raw_row,
                                                 static_cast<size_t>(slot) * raw_row, slots));
  }
  int64_t k = 0;
  for (int q = 0; q < W; ++q) {
    if (item.count[q] == 0) continue;
    LOGPROB_ASSIGN_OR_RETURN(k, GemmAndStats(slots + static_cast<size_t>(q * slot) * raw_row, item.dtype, item.first[q],
                                             item.count[q], G, k, /*wait_uploads=*/W == 1, item.vocab_begin, spec));
  }
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stats_.get()), "row partials kernel");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()), "lm_head GEMM");
  if (W == 1) return Download(records_dev_.get(), static_cast<size_t>(n) * words * 4, own_records);
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  for (int q = 0; q < W; ++q) {
    send_bytes[q] = item.count[q] * static_cast<int64_t>(words) * 4;
    recv_bytes[q] = mine * static_cast<int64_t>(words) * 4;
  }
  const size_t recv_total = static_cast<size_t>(W * mine) * words * 4;
  LOGPROB_RETURN_IF_ERROR(exchanged_dev_.Reserve(std::max<size_t>(recv_total, 1)));
  LOGPROB_RETURN_IF_ERROR(comm.AllToAllVDevice(records_dev_.get(), send_bytes, exchanged_dev_.get(), recv_bytes));
  return Download(exchanged_dev_.get(), recv_total, own_records);
}

absl::StatusOr<DevicePayload> CudaBackend::OpenCudaIpcPayload(std::string_view handle, int64_t offset, int64_t bytes) {
  return OpenCudaIpc(device_, handle, offset, bytes);
}

int64_t CudaBackend::device_memory_bytes() const {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
  return static_cast<int64_t>(total_bytes - free_bytes);
}

}  // namespace logprob::cuda
