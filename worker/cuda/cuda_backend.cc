#include "worker/cuda/cuda_backend.h"

#include <cuda.h>  // CUpointer_attribute, CUdeviceptr (types only: the function comes from the runtime)
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/communicator.h"
#include "worker/cuda/cuda_device_copy.h"
#include "worker/cuda/cuda_ipc.h"
#include "worker/cuda/cuda_slice_backward.h"
#include "worker/cuda/elem_type.h"
#include "worker/cuda/row_kernels.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::cuda {

RowBlockArgs RowArgsOf(const kernels::StatsSpec& spec) {
  RowBlockArgs a;
  a.temperature = spec.temperature;
  a.entropy = spec.entropy ? 1 : 0;
  a.log_sum_sq_probs = spec.log_sum_sq_probs ? 1 : 0;
  a.mean_logits = spec.mean_logits ? 1 : 0;
  a.is_top1 = spec.is_top1 ? 1 : 0;
  a.topk = spec.topk;
  a.gather_k = spec.gather_k;
  return a;
}

namespace {

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

using CuPointerGetAttributesFn = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

/// cuPointerGetAttributes from the driver the runtime loaded; null if missing.
CuPointerGetAttributesFn PointerAttributes() {
  static const CuPointerGetAttributesFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<CuPointerGetAttributesFn>(nullptr);
    }
    return reinterpret_cast<CuPointerGetAttributesFn>(p);
  }();
  return fn;
}

/// Whether `p` is page-locked host memory the driver knows (cudaMallocHost,
/// cudaHostAlloc, cudaHostRegister by anyone): cudaPointerGetAttributes
/// says cudaMemoryTypeHost, "allocated or registered by CUDA" (pageable
/// memory is cudaMemoryTypeUnregistered). cudaHostGetFlags is no test: it
/// knows cudaHostAlloc's allocations only, not registered ranges. Sets
/// *device to its device mapping.
bool IsPinnedHost(const char* p, const char** device) {
  cudaPointerAttributes a{};
  if (ClearedError(cudaPointerGetAttributes(&a, p)) != cudaSuccess || a.type != cudaMemoryTypeHost) return false;
  *device = static_cast<const char*>(a.devicePointer);
  return *device != nullptr;
}

/// The extent [begin, end) of the page-locked host allocation holding `p`,
/// or {p, p} when `p` is not page-locked host memory the driver knows
/// (IsPinnedHost) or the driver cannot say. The range attributes are
/// documented for device pointers: they are asked of the allocation's
/// device mapping and carried back to host addresses, and the extent's
/// last byte must be page-locked host memory too.
std::pair<const char*, const char*> PinnedExtent(const char* p) {
  const char* dev = nullptr;
  if (!IsPinnedHost(p, &dev)) return {p, p};
  CuPointerGetAttributesFn get = PointerAttributes();
  if (!get) return {p, p};
  CUdeviceptr start = 0;
  size_t size = 0;
  CUpointer_attribute attrs[2] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void* data[2] = {&start, &size};
  if (get(2, attrs, data, reinterpret_cast<CUdeviceptr>(dev)) != CUDA_SUCCESS || size == 0) return {p, p};
  const char* dev_begin = reinterpret_cast<const char*>(start);
  if (dev < dev_begin || dev >= dev_begin + size) return {p, p};
  const char* begin = p - (dev - dev_begin);
  const char* last_dev = nullptr;
  if (!IsPinnedHost(begin + size - 1, &last_dev) || last_dev != dev_begin + size - 1) return {p, p};
  return {begin, begin + size};
}

/// The pass's targets and gather ids in pass order (rank q's rows from
/// record row pass.record_row[q]), for UploadIds.
BlockRows PassIds(const BlockRows& item_rows, const PassLayout& pass, const kernels::StatsSpec& spec,
                  std::vector<int64_t>* targets, std::vector<int64_t>* gather_ids) {
  const int k = spec.gather_k;
  targets->clear();
  gather_ids->clear();
  for (size_t q = 0; q < pass.count.size(); ++q) {
    const int64_t f = pass.item_first[q], c = pass.count[q];
    targets->insert(targets->end(), item_rows.targets + f, item_rows.targets + f + c);
    if (k) gather_ids->insert(gather_ids->end(), item_rows.gather_ids + f * k, item_rows.gather_ids + (f + c) * k);
  }
  return BlockRows{static_cast<int64_t>(targets->size()), targets->data(), k ? gather_ids->data() : nullptr};
}

}  // namespace

absl::Status CudaBackend::Workspace::Create() {
  for (int i = 0; i < 2; ++i) {
    LOGPROB_RETURN_IF_ERROR(copied[i].Create());
    LOGPROB_RETURN_IF_ERROR(computed[i].Create());
    LOGPROB_RETURN_IF_ERROR(gemm_done[i].Create());
    LOGPROB_RETURN_IF_ERROR(stats_done[i].Create());
  }
  for (Event& e : tail) LOGPROB_RETURN_IF_ERROR(e.Create());
  return absl::OkStatus();
}

absl::Status CudaBackend::Workspace::ReserveUploadEvents(int64_t chunks) {
  while (static_cast<int64_t>(uploaded.size()) < chunks) {
    auto e = std::make_unique<Event>();
    LOGPROB_RETURN_IF_ERROR(e->Create());
    uploaded.push_back(std::move(e));
  }
  return absl::OkStatus();
}

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
  if (const char* env = std::getenv("LOGPROB_TEST_FAIL_GEMM_AFTER"); env && *env)
    b->options_.fail_gemm_after = std::strtoll(env, nullptr, 10);
  if (const char* env = std::getenv("LOGPROB_TEST_TRAP_FILE"); env && *env) b->options_.trap_file = env;
  int read_only = 0;
  if (cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, device) != cudaSuccess) {
    cudaGetLastError();
    read_only = 0;
  }
  b->read_only_register_ = read_only != 0;
  LOGPROB_RETURN_IF_ERROR(b->compute_.Create());
  LOGPROB_RETURN_IF_ERROR(b->copy_.Create());
  LOGPROB_RETURN_IF_ERROR(b->stats_.Create());
  {
    absl::MutexLock lock(&b->mu_);
    LOGPROB_RETURN_IF_ERROR(b->ws_.Create());
  }
  absl::MutexLock lock(&b->item_mu_);
  LOGPROB_RETURN_IF_ERROR(b->item_ws_.Create());
  return b;
}

absl::StatusOr<std::shared_ptr<const LmHeadWeights>> CudaBackend::LoadLmHead(LmHeadSlice slice,
                                                                             LmHeadPrecision precision) {
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  // The GEMM's one algorithm (every M runs it) is chosen for the usual
  // chunk (GemmChunkRows), at most 4096 rows.
  const int64_t chunk_rows = std::min<int64_t>(RowsInBudget(options_.gemm_chunk_bytes, slice.rows), 4096);
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadTransform(slice));
  LOGPROB_ASSIGN_OR_RETURN(auto gemm, CublasLtLmHead::Create(slice.dtype, slice.weight.data(), slice.weight.size(),
                                                             slice.rows, slice.hidden_size, precision, chunk_rows,
                                                             &lm_head_buffers_, &lm_head_staging_));
  // The head's bias, multiplier and softcap: applied to every GEMM output
  // (CublasLtLmHead::Compute), before any statistics kernel reads it.
  LOGPROB_RETURN_IF_ERROR(gemm->SetTransform(slice.transform, slice.bias));
  return std::shared_ptr<const LmHeadWeights>(
      std::make_shared<CudaLmHead>(std::move(gemm), device_, slice.transform, std::move(slice.bias)));
}

absl::Status CudaBackend::WaitForStreams() const {
  absl::Status first;
  for (const Stream* s : {&copy_, &compute_, &stats_}) {
    // CudaStatus clears a handled error and records a sticky one
    // (StickyErrorSeen: the worker answers UNAVAILABLE, the pool re-forms)
    // even where the caller drops the status (an error exit's cleanup).
    const absl::Status st = CudaStatus(cudaStreamSynchronize(s->get()), "device work");
    if (first.ok()) first = st;
  }
  return first;
}

void CudaBackend::RecordTails(Workspace& w) const {
  const Stream* streams[3] = {&copy_, &compute_, &stats_};
  for (int i = 0; i < 3; ++i)
    if (ClearedError(cudaEventRecord(w.tail[i].get(), streams[i]->get())) != cudaSuccess) {
      // The event keeps its older record; wait for the stream instead
      // (a sticky error is recorded; WaitTails then reports it).
      CudaStatus(cudaStreamSynchronize(streams[i]->get()), "device work").IgnoreError();
    }
}

absl::Status CudaBackend::WaitTails(Workspace& w) {
  absl::Status st;
  for (Event& e : w.tail)
    if (cudaError_t r = cudaEventSynchronize(e.get()); r != cudaSuccess && st.ok()) st = CudaStatus(r, "device work");
  return st;
}

absl::Status CudaBackend::UploadIds(Workspace& w, const BlockRows& rows, const kernels::StatsSpec& spec) {
  const size_t n = static_cast<size_t>(rows.count);
  LOGPROB_RETURN_IF_ERROR(w.targets.Reserve(std::max<size_t>(n * 8, 1)));
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(w.targets.get(), rows.targets, n * 8, cudaMemcpyHostToDevice, compute_.get()), "targets");
  if (spec.gather_k > 0) {
    const size_t bytes = n * static_cast<size_t>(spec.gather_k) * 8;
    LOGPROB_RETURN_IF_ERROR(w.gather.Reserve(std::max<size_t>(bytes, 1)));
    LOGPROB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(w.gather.get(), rows.gather_ids, bytes, cudaMemcpyHostToDevice, compute_.get()), "gather ids");
  }
  const size_t words = kernels::PartialWords(spec);
  LOGPROB_RETURN_IF_ERROR(w.records.Reserve(std::max<size_t>(n * words * 4, 1)));
  if (spec.topk > 0) {
    LOGPROB_RETURN_IF_ERROR(w.topk_x.Reserve(std::max<size_t>(n * spec.topk * 4, 1)));
    LOGPROB_RETURN_IF_ERROR(w.topk_id.Reserve(std::max<size_t>(n * spec.topk * 4, 1)));
  }
  return absl::OkStatus();
}

void CudaBackend::PointAtRows(const Workspace& w, int64_t r0, int64_t n, const kernels::StatsSpec& spec,
                              RowBlockArgs* args) {
  args->rows = n;
  args->targets = w.targets.get<int64_t>() + r0;
  args->gather_ids = spec.gather_k ? w.gather.get<int64_t>() + r0 * spec.gather_k : nullptr;
  args->records = w.records.get<uint32_t>() + r0 * static_cast<int64_t>(kernels::PartialWords(spec));
  args->topk_scratch_x = spec.topk ? w.topk_x.get<float>() + r0 * spec.topk : nullptr;
  args->topk_scratch_id = spec.topk ? w.topk_id.get<int32_t>() + r0 * spec.topk : nullptr;
}

absl::Status CudaBackend::Download(Workspace& w, const void* src, size_t bytes, void* dst) {
  LOGPROB_RETURN_IF_ERROR(w.records_host.Reserve(std::max<size_t>(bytes, 1)));
  LOGPROB_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(w.records_host.get(), src, bytes, cudaMemcpyDeviceToHost, compute_.get()), "records download");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()), "row kernels");
  std::memcpy(dst, w.records_host.get(), bytes);
  return absl::OkStatus();
}

absl::Status CudaBackend::FetchRecords(Workspace& w, int64_t rows, const kernels::StatsSpec& spec, uint32_t* records) {
  return Download(w, w.records.get(), static_cast<size_t>(rows) * kernels::PartialWords(spec) * 4, records);
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
  // Whatever the exit, nothing queued here still runs (declared after the
  // lock, so it runs before the unlock).
  absl::Cleanup drain = [this] { WaitForStreams().IgnoreError(); };
  Workspace& w = ws_;
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  const size_t row_bytes = static_cast<size_t>(block.len) * DTypeSize(block.dtype);
  const int64_t sub = std::clamp<int64_t>(static_cast<int64_t>(options_.staging_bytes / row_bytes), 1, rows.count);
  LOGPROB_RETURN_IF_ERROR(UploadIds(w, rows, spec));
  if (filter) LOGPROB_RETURN_IF_ERROR(w.keep_min.Reserve(static_cast<size_t>(rows.count) * 4));
  // Page-locked logits (a payload region the worker registered) upload
  // straight from where they are; others through the pinned buffers.
  const bool direct = IsPageLocked(block.data, static_cast<size_t>(rows.count) * row_bytes);
  for (int b = 0; b < 2; ++b) {
    if (!direct) LOGPROB_RETURN_IF_ERROR(w.staging_host[b].Reserve(sub * row_bytes));
    LOGPROB_RETURN_IF_ERROR(w.staging_dev[b].Reserve(sub * row_bytes));
  }
  RowBlockArgs args = RowArgsOf(spec);
  args.type = ElemTypeOf(block.dtype);
  args.row_stride = args.len = block.len;
  args.vocab_begin = block.vocab_begin;
  for (int64_t r0 = 0, i = 0; r0 < rows.count; r0 += sub, ++i) {
    const int64_t n = std::min(sub, rows.count - r0);
    const int b = static_cast<int>(i % 2);
    // Pinned buffer b is free once its previous upload finished; device
    // buffer b once the kernels that read it finished.
    const char* from = static_cast<const char*>(block.data) + r0 * row_bytes;
    if (!direct) {
      LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(w.copied[b].get()), "staging upload");
      std::memcpy(w.staging_host[b].get(), from, n * row_bytes);
      from = w.staging_host[b].get<char>();
    }
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_.get(), w.computed[b].get(), 0), "wait");
    LOGPROB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(w.staging_dev[b].get(), from, n * row_bytes, cudaMemcpyHostToDevice, copy_.get()),
        "logits upload");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(w.copied[b].get(), copy_.get()), "event");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_.get(), w.copied[b].get(), 0), "wait");
    args.logits = w.staging_dev[b].get();
    PointAtRows(w, r0, n, spec, &args);
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
      f.keep_min = w.keep_min.get<float>() + r0;
      LOGPROB_CUDA_RETURN_IF_ERROR(LaunchSamplingKeepMin(f, compute_.get()), "sampling filter kernel");
      args.keep_min = f.keep_min;
    }
    LOGPROB_CUDA_RETURN_IF_ERROR(LaunchRowPartials(args, compute_.get()), "row partials kernel");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(w.computed[b].get(), compute_.get()), "event");
  }
  LOGPROB_RETURN_IF_ERROR(FetchRecords(w, rows.count, spec, records));
  // Every stream's work ran without an error (the copy stream's too).
  std::move(drain).Cancel();
  return WaitForStreams();
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

int64_t CudaBackend::GemmChunkRows(const CublasLtLmHead& gemm, int64_t M) const {
  int64_t g = RowsInBudget(options_.gemm_chunk_bytes, gemm.logits_stride());
  if (g < M) g -= g % kSlotAlignRows;
  return std::min(g, M);
}

absl::Status CudaBackend::Gemm(CublasLtLmHead& gemm, const void* a, int64_t n, float* out) {
  if (options_.fail_gemm_after >= 0) {
    const int64_t done = gemms_.load(std::memory_order_relaxed);
    if (done == options_.fail_gemm_after) {
      gemms_.store(done + 1, std::memory_order_relaxed);  // once
      return absl::InternalError(absl::StrCat("lm_head GEMM: injected failure after ", done, " GEMMs"));
    }
  }
  // Test hook: a device fault, once per trap file (unlink: one taker).
  if (!options_.trap_file.empty() && ::unlink(options_.trap_file.c_str()) == 0) {
    std::fprintf(stderr, "logprob-worker: test hook: %s taken, trapping on the device\n", options_.trap_file.c_str());
    LOGPROB_CUDA_RETURN_IF_ERROR(LaunchTrap(compute_.get()), "trap kernel");
  }
  LOGPROB_RETURN_IF_ERROR(gemm.Compute(a, n, out, compute_.get()));
  gemms_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status CudaBackend::ReserveStaging(Workspace& w, const char* src, bool on_device, int64_t rows, size_t row_bytes,
                                         int64_t G, bool* direct) const {
  *direct = on_device || IsPageLocked(src, static_cast<size_t>(rows) * row_bytes);
  if (!*direct)
    for (int b = 0; b < 2; ++b) LOGPROB_RETURN_IF_ERROR(w.staging_host[b].Reserve(static_cast<size_t>(G) * row_bytes));
  return w.ReserveUploadEvents((rows + G - 1) / G);
}

absl::Status CudaBackend::UploadChunk(Workspace& w, const char* src, bool on_device, bool direct, int64_t c, int64_t G,
                                      int64_t n, size_t row_bytes, char* dst) {
  const size_t bytes = static_cast<size_t>(n) * row_bytes, at = static_cast<size_t>(c * G) * row_bytes;
  if (direct) {
    LOGPROB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst + at, src + at, bytes, on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice,
                        copy_.get()),
        "hidden states upload");
  } else {
    // Pageable memory: copy into pinned buffer b (free once its previous
    // upload finished) while earlier chunks upload and multiply.
    const int b = static_cast<int>(c % 2);
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(w.copied[b].get()), "staging upload");
    std::memcpy(w.staging_host[b].get(), src + at, bytes);
    LOGPROB_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst + at, w.staging_host[b].get(), bytes, cudaMemcpyHostToDevice, copy_.get()),
        "hidden states upload");
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(w.copied[b].get(), copy_.get()), "event");
  }
  return CudaStatus(cudaEventRecord(w.uploaded[c]->get(), copy_.get()), "event");
}

template <typename Consume>
absl::Status CudaBackend::Pipeline(Workspace& w, const char* src, bool on_device, int64_t rows, size_t row_bytes,
                                   int64_t G, char* dst, Consume consume) {
  bool direct = false;
  LOGPROB_RETURN_IF_ERROR(ReserveStaging(w, src, on_device, rows, row_bytes, G, &direct));
  const int64_t chunks = (rows + G - 1) / G;
  for (int64_t c = 0; c < chunks; ++c) {
    LOGPROB_RETURN_IF_ERROR(UploadChunk(w, src, on_device, direct, c, G, std::min(G, rows - c * G), row_bytes, dst));
    if (c > 0) LOGPROB_RETURN_IF_ERROR(consume(c - 1));
  }
  if (chunks > 0) LOGPROB_RETURN_IF_ERROR(consume(chunks - 1));
  return absl::OkStatus();
}

absl::StatusOr<const void*> CudaBackend::ChunkOperand(Workspace& w, const CublasLtLmHead& gemm, const char* hidden,
                                                      DType dtype, int64_t l0, int64_t n, int64_t G, int64_t upload) {
  if (upload >= 0)
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_.get(), w.uploaded[upload]->get(), 0), "wait");
  const int64_t H = gemm.hidden_size();
  const void* a = hidden + static_cast<size_t>(l0 * H) * DTypeSize(dtype);
  if (dtype == gemm.compute_dtype()) return a;
  // hidden_dev holds one chunk: the previous chunk's GEMM, queued before
  // on this stream, has read it.
  LOGPROB_RETURN_IF_ERROR(w.hidden_dev.Reserve(static_cast<size_t>(G * H) * DTypeSize(gemm.compute_dtype())));
  LOGPROB_CUDA_RETURN_IF_ERROR(
      LaunchConvert(a, ElemTypeOf(dtype), n * H, w.hidden_dev.get(), ElemTypeOf(gemm.compute_dtype()), compute_.get()),
      "hidden states conversion");
  return static_cast<const void*>(w.hidden_dev.get());
}

absl::Status CudaBackend::GemmAndStatsChunk(Workspace& w, CublasLtLmHead& gemm, const char* hidden, DType dtype,
                                            int64_t row0, int64_t n, int64_t G, int64_t k, int64_t upload,
                                            int64_t vocab_begin, const kernels::StatsSpec& spec) {
  const int64_t N = gemm.rows(), S = gemm.logits_stride();
  for (int b = 0; b < 2; ++b) LOGPROB_RETURN_IF_ERROR(w.chunk_logits[b].Reserve(static_cast<size_t>(G * S) * 4));
  RowBlockArgs args = RowArgsOf(spec);
  args.type = ElemType::kF32;
  args.len = N;
  args.row_stride = S;
  args.vocab_begin = vocab_begin;
  const int b = static_cast<int>(k % 2);
  LOGPROB_ASSIGN_OR_RETURN(const void* a, ChunkOperand(w, gemm, hidden, dtype, 0, n, G, upload));
  // Logits buffer b is free once the statistics of chunk k - 2 read it.
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_.get(), w.stats_done[b].get(), 0), "wait");
  LOGPROB_RETURN_IF_ERROR(Gemm(gemm, a, n, w.chunk_logits[b].get<float>()));
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventRecord(w.gemm_done[b].get(), compute_.get()), "event");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stats_.get(), w.gemm_done[b].get(), 0), "wait");
  args.logits = w.chunk_logits[b].get();
  PointAtRows(w, row0, n, spec, &args);
  LOGPROB_CUDA_RETURN_IF_ERROR(LaunchRowPartials(args, stats_.get()), "row partials kernel");
  return CudaStatus(cudaEventRecord(w.stats_done[b].get(), stats_.get()), "event");
}

absl::Status CudaBackend::HiddenPartials(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden,
                                         int64_t vocab_begin, const BlockRows& rows, const kernels::StatsSpec& spec,
                                         uint32_t* records) {
  if (rows.count <= 0) return absl::OkStatus();
  if (lm_head.rows() <= 0) {
    EmptySliceRecords(rows, vocab_begin, spec, records);
    return absl::OkStatus();
  }
  // One fused path on the GPU: a block of rows is a one-rank item of the
  // one-pass path, whose records are [1][rows.count][words].
  HiddenItemRows item;
  item.dtype = hidden_dtype;
  item.own = hidden;
  item.vocab_begin = vocab_begin;
  item.first = {0};
  item.count = {rows.count};
  item.rows = rows;
  SelfCommunicator self;
  return HiddenItemPartials(lm_head, item, self, spec, records);
}

absl::Status CudaBackend::HiddenLogits(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t M,
                                       float* logits) {
  if (M <= 0) return absl::OkStatus();
  LOGPROB_RETURN_IF_ERROR(kernels::CheckHiddenStatesDType(hidden_dtype));
  CublasLtLmHead& gemm = static_cast<const CudaLmHead&>(lm_head).gemm();
  absl::MutexLock lock(&mu_);
  // Also: no download into `logits` still runs once this returns.
  absl::Cleanup drain = [this] { WaitForStreams().IgnoreError(); };
  Workspace& w = ws_;
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  const int64_t N = gemm.rows(), S = gemm.logits_stride(), G = GemmChunkRows(gemm, AlignRows(M));
  const size_t raw_row = static_cast<size_t>(gemm.hidden_size()) * DTypeSize(hidden_dtype);
  LOGPROB_RETURN_IF_ERROR(w.hidden_raw.Reserve(static_cast<size_t>(M) * raw_row));
  LOGPROB_RETURN_IF_ERROR(w.logits_dev.Reserve(static_cast<size_t>(G * S) * 4));
  char* dev = w.hidden_raw.get<char>();
  LOGPROB_RETURN_IF_ERROR(Pipeline(
      w, static_cast<const char*>(hidden), /*on_device=*/false, M, raw_row, G, dev,
      [&](int64_t c) ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
        const int64_t r0 = c * G, n = std::min(G, M - r0);
        LOGPROB_ASSIGN_OR_RETURN(const void* a, ChunkOperand(w, gemm, dev + r0 * raw_row, hidden_dtype, 0, n, G, c));
        LOGPROB_RETURN_IF_ERROR(Gemm(gemm, a, n, w.logits_dev.get<float>()));
        // Rows S floats apart on the device, N apart (dense) in `logits`.
        return CudaStatus(cudaMemcpy2DAsync(logits + r0 * N, static_cast<size_t>(N) * 4, w.logits_dev.get(),
                                            static_cast<size_t>(S) * 4, static_cast<size_t>(N) * 4,
                                            static_cast<size_t>(n), cudaMemcpyDeviceToHost, compute_.get()),
                          "logits download");
      }));
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_.get()), "lm_head GEMM");
  std::move(drain).Cancel();
  return WaitForStreams();
}

absl::Status CudaBackend::ReserveItem(Workspace& w, const CublasLtLmHead& gemm, const HiddenItemRows& item, int me,
                                      const OnePassLayout& layout, const kernels::StatsSpec& spec) const {
  const int W = layout.rows().size();
  const int64_t H = gemm.hidden_size(), S = gemm.logits_stride();
  const size_t raw_row = static_cast<size_t>(H) * DTypeSize(item.dtype), words = kernels::PartialWords(spec);
  const int64_t slot = layout.max_slot_rows(), total = layout.max_total_rows();
  const int64_t mine = std::min(layout.pass_rows(), layout.rows().count[me]);
  const int64_t G = GemmChunkRows(gemm, slot);
  int64_t chunks = 0;
  for (int64_t p = 0; p < layout.passes(); ++p) {
    const PassLayout pass = layout.Pass(p);
    const int64_t g = GemmChunkRows(gemm, pass.slot_rows);
    chunks = std::max(chunks, (pass.count[me] + g - 1) / g);
  }
  LOGPROB_RETURN_IF_ERROR(w.ReserveUploadEvents(chunks));
  LOGPROB_RETURN_IF_ERROR(w.hidden_raw.Reserve(static_cast<size_t>(W * slot) * raw_row));
  if (item.dtype != gemm.compute_dtype())
    LOGPROB_RETURN_IF_ERROR(w.hidden_dev.Reserve(static_cast<size_t>(G * H) * DTypeSize(gemm.compute_dtype())));
  for (int b = 0; b < 2; ++b) LOGPROB_RETURN_IF_ERROR(w.chunk_logits[b].Reserve(static_cast<size_t>(G * S) * 4));
  const size_t t = static_cast<size_t>(std::max<int64_t>(total, 1));
  LOGPROB_RETURN_IF_ERROR(w.targets.Reserve(t * 8));
  if (spec.gather_k) LOGPROB_RETURN_IF_ERROR(w.gather.Reserve(t * spec.gather_k * 8));
  LOGPROB_RETURN_IF_ERROR(w.records.Reserve(t * words * 4));
  if (spec.topk) {
    LOGPROB_RETURN_IF_ERROR(w.topk_x.Reserve(t * spec.topk * 4));
    LOGPROB_RETURN_IF_ERROR(w.topk_id.Reserve(t * spec.topk * 4));
  }
  const size_t exchanged = static_cast<size_t>(std::max<int64_t>(W * mine, 1)) * words * 4;
  if (W > 1) LOGPROB_RETURN_IF_ERROR(w.exchanged.Reserve(exchanged));
  LOGPROB_RETURN_IF_ERROR(w.records_host.Reserve(std::max(exchanged, t * words * 4)));
  if (mine > 0 && !item.own_on_device &&
      !IsPageLocked(item.own, static_cast<size_t>(layout.rows().count[me]) * raw_row))
    for (int b = 0; b < 2; ++b) LOGPROB_RETURN_IF_ERROR(w.staging_host[b].Reserve(static_cast<size_t>(G) * raw_row));
  return absl::OkStatus();
}

absl::Status CudaBackend::RunPass(Workspace& w, CublasLtLmHead& gemm, const HiddenItemRows& item, Communicator& comm,
                                  const PassLayout& pass, bool check_stop, const kernels::StatsSpec& spec,
                                  uint32_t* own_records) {
  const int W = comm.size(), me = comm.rank();
  const size_t raw_row = static_cast<size_t>(gemm.hidden_size()) * DTypeSize(item.dtype);
  const size_t words = kernels::PartialWords(spec);
  const int64_t mine = pass.count[me], G = GemmChunkRows(gemm, pass.slot_rows);
  char* slots = w.hidden_raw.get<char>();
  const char* own = static_cast<const char*>(item.own) + static_cast<size_t>(pass.pass_row0) * raw_row;
  const BlockRows ids = PassIds(item.rows, pass, spec, &w.targets_host, &w.gather_host);
  // Queues (under the stream lock, recording w.tail on every exit) the
  // work `queue` returns the status of.
  auto queued = [&](auto&& queue) -> absl::Status {
    absl::MutexLock lock(&mu_);
    absl::Cleanup tails = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { RecordTails(w); };
    return queue();
  };
  // 1. Upload this rank's rows into its slot (W == 1: multiply as they
  // land), unless this rank must stop; once the uploads ran (their
  // execution errors included), all ranks agree to go on, so none enters
  // the all-gather alone (AgreeAfterUploads).
  const bool stopping = check_stop && item.should_stop && item.should_stop();
  const absl::Status uploaded =
      stopping ? absl::OkStatus() : queued([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
        LOGPROB_RETURN_IF_ERROR(UploadIds(w, ids, spec));
        char* dst = slots + pass.SlotOffset(me, raw_row);
        if (W > 1)
          return Pipeline(w, own, item.own_on_device, mine, raw_row, G, dst, [](int64_t) { return absl::OkStatus(); });
        return Pipeline(w, own, item.own_on_device, mine, raw_row, G, dst,
                        [&](int64_t c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                          const int64_t l0 = c * G;
                          return GemmAndStatsChunk(w, gemm, dst + l0 * raw_row, item.dtype, pass.record_row[me] + l0,
                                                   std::min(G, mine - l0), G, c, c, item.vocab_begin, spec);
                        });
      });
  LOGPROB_RETURN_IF_ERROR(AgreeAfterUploads(comm, stopping, pass.slot_rows, uploaded,
                                            [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return WaitTails(w); }));
  const void* result = w.records.get();
  if (W > 1) {
    // 2. All-gather the slots in place (the upload landed before the vote;
    // the collective runs on the communicator's stream; it returns once
    // done).
    LOGPROB_RETURN_IF_ERROR(comm.AllGatherDevice(slots + pass.SlotOffset(me, raw_row), pass.SlotBytes(raw_row), slots));
    // 3. Every rank's rows times this rank's slice.
    const absl::Status gemms = queued([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
      int64_t k = 0;
      for (int q = 0; q < W; ++q)
        for (int64_t l0 = 0; l0 < pass.count[q]; l0 += G, ++k)
          LOGPROB_RETURN_IF_ERROR(GemmAndStatsChunk(w, gemm, slots + pass.SlotOffset(q, raw_row) + l0 * raw_row,
                                                    item.dtype, pass.record_row[q] + l0,
                                                    std::min(G, pass.count[q] - l0), G, k, -1, item.vocab_begin, spec));
      return absl::OkStatus();
    });
    absl::Status done = gemms.ok() ? WaitTails(w) : gemms;
    // 4. Nobody enters the exchange unless every rank has its records.
    LOGPROB_RETURN_IF_ERROR(
        AgreeOnPass(comm, done.ok() ? PassVote::kGo : PassVote::kFailed, pass.slot_rows, done).status());
    std::vector<int64_t> send_bytes, recv_bytes;
    pass.RecordExchange(me, words, &send_bytes, &recv_bytes);
    LOGPROB_RETURN_IF_ERROR(comm.AllToAllVDevice(w.records.get(), send_bytes, w.exchanged.get(), recv_bytes));
    result = w.exchanged.get();
  }
  // 5. This rank's rows' records, [W][mine][words], into their place in
  // the item's [W][count[me]][words].
  const size_t bytes = static_cast<size_t>(W * mine) * words * 4;
  LOGPROB_RETURN_IF_ERROR(queued([&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    // After this rank's statistics kernels (W == 1: nothing else ran).
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_.get(), w.tail[2].get(), 0), "wait");
    return CudaStatus(cudaMemcpyAsync(w.records_host.get(), result, bytes, cudaMemcpyDeviceToHost, copy_.get()),
                      "records download");
  }));
  LOGPROB_RETURN_IF_ERROR(WaitTails(w));
  const int64_t rows_me = item.count[me];
  for (int q = 0; q < W; ++q)
    std::memcpy(own_records + RecordIndex(q, pass.pass_row0, rows_me, words),
                w.records_host.get<uint32_t>() + RecordIndex(q, 0, mine, words), static_cast<size_t>(mine) * words * 4);
  return absl::OkStatus();
}

absl::Status CudaBackend::HiddenItemPartials(const LmHeadWeights& lm_head, const HiddenItemRows& item,
                                             Communicator& comm, const kernels::StatsSpec& spec,
                                             uint32_t* own_records) {
  if (!OnePassHidden(comm))
    return absl::UnimplementedError("hidden states in one pass need W == 1 or device collectives (NCCL)");
  const int W = comm.size(), me = comm.rank();
  RankRows ranks{item.first, item.count};
  LOGPROB_RETURN_IF_ERROR(CheckRankRows(ranks, W, item.rows.count));
  if (item.count[me] > 0 && item.own == nullptr) return absl::InvalidArgumentError("hidden-states item: no rows");
  LOGPROB_RETURN_IF_ERROR(kernels::CheckHiddenStatesDType(item.dtype));
  if (item.rows.count == 0) return absl::OkStatus();
  CublasLtLmHead& gemm = static_cast<const CudaLmHead&>(lm_head).gemm();
  const size_t raw_row = static_cast<size_t>(gemm.hidden_size()) * DTypeSize(item.dtype);
  absl::MutexLock item_lock(&item_mu_);
  Workspace& w = item_ws_;
  // A failure to select the device is voted on below, like any other.
  const absl::Status selected = CudaStatus(cudaSetDevice(device_), "cudaSetDevice");
  // Whatever the exit, nothing this item queued still runs: no GEMM or
  // kernel on item_ws_ (the next item rewrites it) and no copy reading
  // `item.own` (a CUDA IPC mapping or payload region may go once this
  // returns).
  absl::Cleanup drain = [&w]() ABSL_NO_THREAD_SAFETY_ANALYSIS { WaitTails(w).IgnoreError(); };
  auto stop = [&item] { return item.should_stop && item.should_stop(); };
  // Reserve the largest pass, then agree before any device collective.
  int64_t pass_rows = PassRowsForBudget(options_.pass_bytes, W, raw_row);
  const absl::Status reserved =
      selected.ok() ? ReserveItem(w, gemm, item, me, OnePassLayout(ranks, pass_rows), spec) : selected;
  LOGPROB_ASSIGN_OR_RETURN(pass_rows, AgreeOnPass(comm,
                                                  !reserved.ok() ? PassVote::kFailed
                                                  : stop()       ? PassVote::kCancelled
                                                                 : PassVote::kGo,
                                                  pass_rows, reserved));
  const OnePassLayout layout(std::move(ranks), pass_rows);
  // Pass 0's cancellation was part of the agreement above.
  for (int64_t p = 0; p < layout.passes(); ++p)
    LOGPROB_RETURN_IF_ERROR(RunPass(w, gemm, item, comm, layout.Pass(p), /*check_stop=*/p > 0, spec, own_records));
  return absl::OkStatus();
}

void CudaBackend::RegisterHostMemory(const void* data, size_t bytes) {
  if (!data || bytes == 0) return;
  absl::MutexLock lock(&reg_mu_);
  if (!read_only_register_) {
    // Payload regions are mapped PROT_READ: without the read-only flag
    // every registration would fail; say so once, try none.
    if (!register_failed_)
      std::fprintf(stderr,
                   "logprob-worker: CUDA device %d cannot register read-only host memory "
                   "(cudaDevAttrHostRegisterReadOnlySupported = 0); uploads from payload regions go through "
                   "the staging buffers\n",
                   device_);
    register_failed_ = true;
    return;
  }
  if (registered_.count(static_cast<const char*>(data))) return;
  if (cudaSetDevice(device_) != cudaSuccess) return;
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
  // Nothing left behind as the thread's last error (the next launch on this
  // thread would report it as its own); a sticky error is recorded.
  const cudaError_t selected = ClearedError(cudaSetDevice(device_));
  const cudaError_t e =
      selected != cudaSuccess ? selected : ClearedError(cudaHostUnregister(const_cast<char*>(it->first)));
  if (e != cudaSuccess)
    std::fprintf(stderr, "logprob-worker: cudaHostUnregister of a payload region failed: %s\n",
                 std::string(CudaStatus(e, "cudaHostUnregister").message()).c_str());
  registered_.erase(it);
}

bool CudaBackend::IsPageLocked(const void* data, size_t bytes) const {
  if (!data || bytes == 0) return false;
  const char* p = static_cast<const char*>(data);
  const char* const end = p + bytes;
  // Walk the range allocation by allocation: each step must start inside a
  // registered range or a page-locked allocation the driver knows, and
  // continues at its end; a pageable byte anywhere stops it.
  while (p < end) {
    const char* next = p;
    {
      absl::MutexLock lock(&reg_mu_);
      auto it = registered_.upper_bound(p);
      if (it != registered_.begin()) {
        --it;
        if (p < it->first + it->second) next = it->first + it->second;
      }
    }
    if (next == p) next = PinnedExtent(p).second;
    if (next <= p) return false;
    p = next;
  }
  return true;
}

absl::StatusOr<DevicePayload> CudaBackend::OpenCudaIpcPayload(std::string_view handle, int64_t offset, int64_t bytes,
                                                              int64_t allocation_bytes) {
  return OpenCudaIpc(device_, handle, offset, bytes, allocation_bytes);
}

absl::StatusOr<std::unique_ptr<DeviceCopy>> CudaBackend::NewDeviceCopy() {
  LOGPROB_ASSIGN_OR_RETURN(std::unique_ptr<CudaDeviceCopy> copy, CudaDeviceCopy::Create(device_));
  return std::unique_ptr<DeviceCopy>(std::move(copy));
}

int64_t CudaBackend::device_memory_bytes() const {
  size_t free_bytes = 0, total_bytes = 0;
  // A failure is cleared (this runs between requests, on threads that
  // launch kernels) and a sticky one recorded; 0 is then the answer.
  if (!CudaStatus(ClearedError(cudaSetDevice(device_)), "cudaSetDevice").ok() ||
      !CudaStatus(ClearedError(cudaMemGetInfo(&free_bytes, &total_bytes)), "cudaMemGetInfo").ok())
    return 0;
  return static_cast<int64_t>(total_bytes - free_bytes);
}

absl::StatusOr<std::unique_ptr<SliceBackward>> CudaBackend::HeadBackward(const LmHeadWeights& lm_head,
                                                                         int64_t vocab_begin, float temperature) {
  return CudaSliceBackward::Create(this, static_cast<const CudaLmHead&>(lm_head), vocab_begin, temperature);
}

absl::Status CudaBackend::RunOnComputeStream(absl::FunctionRef<absl::Status(cudaStream_t)> work) {
  absl::MutexLock lock(&mu_);
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  const absl::Status done = work(compute_.get());
  // Nothing queued by `work` still runs once this returns, whatever the exit.
  const absl::Status waited = WaitForStreams();
  return done.ok() ? waited : done;
}

}  // namespace logprob::cuda
