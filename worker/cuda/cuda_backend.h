// The CUDA backend: the row kernels (row_partials.cu, sampling_filter.cu)
// and the cuBLASLt lm_head GEMM behind ScoringBackend. Logits and GEMM
// output stay on the device; only the packed partial records come back.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "common/input_kind.h"
#include "worker/cuda/device_buffers.h"
#include "worker/cuda/lm_head_gemm_cublaslt.h"
#include "worker/cuda/row_kernels.h"
#include "worker/cuda/select_device.h"
#include "worker/scoring/backend.h"
#include "worker/scoring/one_pass_layout.h"

namespace logprob::cuda {

/// The row kernel's arguments for the statistics `spec` asks (temperature,
/// record fields, top-k, gather ids); the block's pointers and shape are
/// the caller's to set.
RowBlockArgs RowArgsOf(const kernels::StatsSpec& spec);

/// An lm_head slice in this backend's device memory: its cuBLASLt GEMM
/// (which applies the head's transform to its output), on CUDA device
/// `device`. The destructor frees it with `device` current (SelectDevice),
/// whichever thread drops the last reference (a gRPC thread of the worker
/// that never selected it: LmHeadRegistry::Drop).
class CudaLmHead final : public LmHeadWeights {
 public:
  CudaLmHead(std::unique_ptr<CublasLtLmHead> gemm, int device, LmHeadTransform transform = {},
             std::vector<float> bias = {})
      : LmHeadWeights(gemm->rows(), gemm->hidden_size(), transform, std::move(bias)),
        gemm_(std::move(gemm)),
        device_(device) {}
  ~CudaLmHead() override {
    SelectDevice(device_);
    gemm_.reset();
  }
  /// The CUDA device the weights live on.
  int device() const { return device_; }
  /// The weights and the bias (on the device and its host copy).
  size_t bytes() const override { return gemm_->weight_bytes() + 2 * bias().size() * sizeof(float); }
  /// Queued on the backend's compute stream under its stream lock (one
  /// stream, so GEMMs never share the cuBLASLt workspace concurrently).
  CublasLtLmHead& gemm() const { return *gemm_; }

 private:
  std::unique_ptr<CublasLtLmHead> gemm_;
  int device_;
};

/// CUDA implementation of ScoringBackend on one device. Work is queued on
/// three streams (copy, compute, statistics) under one stream lock; host
/// logits blocks and pageable hidden states are staged through two pinned
/// buffers so the host copy of one chunk and its upload (copy stream)
/// overlap the kernels of the previous one. Every call waits, on every
/// exit, for all the work it queued (so an error never leaves GEMMs or
/// copies running on buffers the next call rewrites or memory the caller
/// frees). Thread-safe: logits calls and HiddenLogits run one at a time;
/// a one-pass hidden-states item (HiddenItemPartials) has buffers of its
/// own and holds the stream lock only while it queues work, not while it
/// waits for the device or for collectives, so token-parallel items run
/// between its steps.
class CudaBackend final : public ScoringBackend {
 public:
  struct Options {
    /// Bytes of host logits uploaded per sub-block (per staging buffer).
    size_t staging_bytes = size_t{64} << 20;
    /// Bytes of f32 logits one GEMM chunk of the hidden-states path may
    /// produce before the statistics kernel consumes it; the chunk is
    /// max(16, this / (4 N)) rows. Smaller keeps it in L2, larger makes the
    /// GEMM compute-bound.
    size_t gemm_chunk_bytes = size_t{256} << 20;
    /// Device bytes of gathered hidden states (W slots) one pass of a
    /// one-pass item may hold: bounds its rows per rank and pass
    /// (PassRowsForBudget), so device memory does not grow with the item.
    /// Ranks agree on the smallest value (AgreeOnPass).
    size_t pass_bytes = size_t{1} << 30;
    /// Test hook: when >= 0, the GEMM call after this many successful ones
    /// fails with INTERNAL ("injected"), once. Create also reads it from
    /// the environment variable LOGPROB_TEST_FAIL_GEMM_AFTER.
    int64_t fail_gemm_after = -1;
    /// Test hook (issue 35 item 2): when not empty and this file exists at
    /// a GEMM call, the call removes it and queues a kernel that executes
    /// `__trap()` first: a device fault (sticky error), once per file, in
    /// the one process that removed it. Create reads it from the
    /// environment variable LOGPROB_TEST_TRAP_FILE.
    std::string trap_file;
  };

  /// Uses `device` (made current); lm_heads come later (LoadLmHead).
  /// FAILED_PRECONDITION without a usable device; INTERNAL for CUDA
  /// failures.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device, const Options& options);
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device) { return Create(device, Options()); }

  std::string name() const override { return "cuda"; }
  /// Bytes in use on the device (cudaMemGetInfo: total - free), 0 when
  /// the runtime cannot say; its error is not left behind (ClearedError).
  int64_t device_memory_bytes() const override;
  /// StickyErrorSeen() (cuda_error.h): this process saw a sticky CUDA error.
  bool device_lost() const override { return StickyErrorSeen().load(); }
  absl::Status SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                             uint32_t* records) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                   const SamplingFilter& filter, uint32_t* records) override ABSL_LOCKS_EXCLUDED(mu_);
  /// Uploads the slice to this device as the cuBLASLt GEMM's operand (one
  /// algorithm for every M, chosen for the usual chunk). Does not wait for
  /// the calls in progress.
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice slice,
                                                                  LmHeadPrecision precision) override;
  /// The one-pass path on one rank (HiddenItemPartials of a one-rank item
  /// over a SelfCommunicator): the GPU has one fused hidden-states path.
  /// The scorer no longer calls it for CUDA workers, whose unfiltered
  /// items all take the one-pass path (OnePassHidden); it keeps the
  /// ScoringBackend contract for tests and benchmarks.
  absl::Status HiddenPartials(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t vocab_begin,
                              const BlockRows& rows, const kernels::StatsSpec& spec, uint32_t* records) override
      ABSL_LOCKS_EXCLUDED(mu_, item_mu_);
  /// The round path of hidden states with sampling filters, the only one
  /// left on the GPU: a filter's threshold (top-k / top-p of the whole
  /// row) needs all V logits of a row in one place, which the one-pass
  /// path's records (per-slice statistics) cannot give, so the scorer
  /// downloads these logits and exchanges full rows on the host
  /// (worker/scoring/scorer.h).
  absl::Status HiddenLogits(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t M,
                            float* logits) override ABSL_LOCKS_EXCLUDED(mu_);
  /// W == 1, or device collectives: NCCL's, or Gloo's staged through host
  /// memory (HostStagedDeviceCollectives), which the worker always gives a
  /// CUDA backend (CanScoreInOnePass, the front-end's rule too). So every
  /// unfiltered hidden-states item takes the one-pass path; the round path
  /// is left to sampling filters (HiddenLogits: see the scorer).
  bool OnePassHidden(const Communicator& comm) const override {
    return CanScoreInOnePass(comm.size(), comm.device_collectives());
  }
  /// The whole item on the device, in passes of at most
  /// PassRowsForBudget(Options::pass_bytes) rows of every rank's share
  /// (worker/scoring/one_pass_layout.h), so device memory is bounded. Before the
  /// first pass every rank reserves the buffers of the largest pass and the
  /// ranks agree (AgreeOnPass) that all succeeded; before each pass they
  /// agree that none is cancelled (HiddenItemRows::should_stop), and before
  /// each record exchange that none failed to queue its GEMMs: no rank
  /// waits in a device collective for a peer that left. Per pass, this
  /// rank's rows are uploaded in GEMM chunks on the copy stream (straight
  /// from page-locked or device memory, else through the two pinned
  /// staging buffers), all-gathered in place (W >= 2), multiplied chunk by
  /// chunk on the compute stream into two alternating logits buffers while
  /// the statistics kernel of the previous chunk runs on a second stream
  /// (W == 1: chunk c uploads while chunk c - 1 multiplies), and the
  /// records, which stay on the device, are exchanged with one device
  /// all-to-all; only this rank's rows' records come back to the host.
  /// Every row runs the same GEMM algorithm and kernels whatever M and its
  /// position (batch invariance). CANCELLED when stopped between passes;
  /// RESOURCE_EXHAUSTED when a peer could not reserve its buffers.
  absl::Status HiddenItemPartials(const LmHeadWeights& lm_head, const HiddenItemRows& item, Communicator& comm,
                                  const kernels::StatsSpec& spec, uint32_t* own_records) override
      ABSL_LOCKS_EXCLUDED(mu_, item_mu_);
  /// cudaHostRegister (read-only, portable) of a payload region, when the
  /// device supports read-only registration (queried once at Create;
  /// otherwise nothing is registered). Failures are logged once and leave
  /// uploads on the staging path.
  void RegisterHostMemory(const void* data, size_t bytes) override ABSL_LOCKS_EXCLUDED(reg_mu_);
  void UnregisterHostMemory(const void* data) override ABSL_LOCKS_EXCLUDED(reg_mu_);
  /// cuda::OpenCudaIpc on this backend's device (worker/cuda/cuda_ipc.h).
  absl::StatusOr<DevicePayload> OpenCudaIpcPayload(std::string_view handle, int64_t offset, int64_t bytes,
                                                   int64_t allocation_bytes) override;
  /// cuda::CudaDeviceCopy on this backend's device (worker/cuda/cuda_device_copy.h).
  absl::StatusOr<std::unique_ptr<DeviceCopy>> NewDeviceCopy() override;
  /// The lm_head's backward on this device (cuda_slice_backward.h): the
  /// slice's cuBLASLt GEMM recomputes the logits, the forward's row kernel
  /// their records, f32 cuBLASLt GEMMs the gradients. INTERNAL when
  /// cuBLASLt cannot be set up.
  absl::StatusOr<std::unique_ptr<SliceBackward>> HeadBackward(const LmHeadWeights& lm_head, int64_t vocab_begin,
                                                              float temperature) override;

  /// Runs `work` with the stream lock held, this device current and the
  /// compute stream (the one the lm_head GEMMs and their cuBLASLt
  /// workspaces are queued on), then waits for everything queued on the
  /// backend's streams, on every exit. `work`'s error first, else the
  /// wait's. For device work outside the scoring calls that must not run
  /// beside them: the lm_head backward's rounds. Thread-safe.
  absl::Status RunOnComputeStream(absl::FunctionRef<absl::Status(cudaStream_t)> work) ABSL_LOCKS_EXCLUDED(mu_);

  int device() const { return device_; }
  /// True when [data, data + bytes) is page-locked host memory all along:
  /// covered by registered ranges (RegisterHostMemory) and other
  /// page-locked allocations (cudaMallocHost, cudaHostRegister: their
  /// extents from the driver), with no pageable gap. Uploads from it need
  /// no staging copy. False for bytes == 0. Thread-safe.
  bool IsPageLocked(const void* data, size_t bytes) const ABSL_LOCKS_EXCLUDED(reg_mu_);
  /// The device buffers of lm_head versions: allocated, reused, kept idle.
  const DeviceRecycler& lm_head_buffers() const { return lm_head_buffers_; }
  /// The staging buffers of weights converted on upload (same counters).
  const DeviceRecycler& lm_head_staging() const { return lm_head_staging_; }

 private:
  CudaBackend() = default;

  /// Device buffers of released lm_head versions, taken by the next
  /// version of the same size (LoadLmHead; issue 34). Lm_heads that
  /// outlive the backend free their buffers themselves.
  DeviceRecycler lm_head_buffers_{/*max_idle=*/1};
  /// The staging buffer (at most 64 MiB) of weights converted on upload,
  /// kept for the next converting load (no cudaMalloc per version).
  DeviceRecycler lm_head_staging_{/*max_idle=*/1};

  /// Device and pinned buffers and events of the call in progress: one set
  /// for the calls serialised by mu_, one for the one-pass item (item_mu_).
  struct Workspace {
    PinnedBuffer staging_host[2], records_host;
    DeviceBuffer staging_dev[2], hidden_raw, hidden_dev, logits_dev, targets, gather, keep_min, records, topk_x,
        topk_id;
    DeviceBuffer chunk_logits[2];  // alternating GEMM outputs
    DeviceBuffer exchanged;        // one-pass: records after the all-to-all
    Event copied[2], computed[2], gemm_done[2], stats_done[2];
    Event tail[3];                                   // one-pass: last work queued on copy, compute, stats
    std::vector<std::unique_ptr<Event>> uploaded;    // per upload chunk
    std::vector<int64_t> targets_host, gather_host;  // one-pass: the pass's ids in pass order
    absl::Status Create();
    /// At least `chunks` upload events.
    absl::Status ReserveUploadEvents(int64_t chunks);
  };

  /// Waits for everything queued on the copy, compute and statistics
  /// streams; returns the first stream's error (CudaStatus: a handled error
  /// is cleared, a sticky one is UNAVAILABLE and sets StickyErrorSeen, so
  /// the worker answers UNAVAILABLE even when an error exit's cleanup
  /// drops this status). The cleanup of every call that holds mu_ for its
  /// whole length, and the last step of its success path.
  absl::Status WaitForStreams() const;
  /// Records w.tail on the three streams (after the work just queued).
  void RecordTails(Workspace& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Waits for w.tail: everything the one-pass item queued so far.
  static absl::Status WaitTails(Workspace& w);

  absl::Status LogitsPartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                              const SamplingFilter* filter, uint32_t* records) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status UploadIds(Workspace& w, const BlockRows& rows, const kernels::StatsSpec& spec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Rows of a GEMM chunk for M rows: RowsInBudget(gemm_chunk_bytes, N),
  /// a multiple of 16 when below M, at most M.
  int64_t GemmChunkRows(const CublasLtLmHead& gemm, int64_t M) const;
  /// Points `args` at rows [r0, r0 + n) of the uploaded ids and the records.
  static void PointAtRows(const Workspace& w, int64_t r0, int64_t n, const kernels::StatsSpec& spec,
                          RowBlockArgs* args);
  absl::Status FetchRecords(Workspace& w, int64_t rows, const kernels::StatsSpec& spec, uint32_t* records)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Copies `bytes` from device memory `src` to host `dst` through the
  /// pinned records buffer, after the compute stream's queued work.
  absl::Status Download(Workspace& w, const void* src, size_t bytes, void* dst) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Queues the upload of chunk c (rows [c * G, c * G + n) of `row_bytes`)
  /// from `src` (host, or device with `on_device`; `direct`: no staging)
  /// to `dst` on the copy stream and records w.uploaded[c] after it.
  absl::Status UploadChunk(Workspace& w, const char* src, bool on_device, bool direct, int64_t c, int64_t G, int64_t n,
                           size_t row_bytes, char* dst) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Uploads `rows` rows in chunks of G and calls consume(c) for chunk c
  /// once chunk c + 1's upload is queued (host staging of chunk c + 1
  /// overlaps the device work of chunk c). Staging buffers must be
  /// reserved when the source is pageable (ReserveStaging).
  template <typename Consume>
  absl::Status Pipeline(Workspace& w, const char* src, bool on_device, int64_t rows, size_t row_bytes, int64_t G,
                        char* dst, Consume consume) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The pinned staging buffers for chunks of G rows of `row_bytes` unless
  /// `src` (rows * row_bytes) is device or page-locked memory; sets *direct.
  absl::Status ReserveStaging(Workspace& w, const char* src, bool on_device, int64_t rows, size_t row_bytes, int64_t G,
                              bool* direct) const;
  /// The GEMM operand of rows [l0, l0 + n) of `hidden` (device, raw dtype
  /// `dtype`): after w.uploaded[upload] when upload >= 0, converted into
  /// w.hidden_dev on the compute stream when `dtype` is not the GEMM's
  /// compute dtype (chunks of G rows).
  absl::StatusOr<const void*> ChunkOperand(Workspace& w, const CublasLtLmHead& gemm, const char* hidden, DType dtype,
                                           int64_t l0, int64_t n, int64_t G, int64_t upload)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// gemm.Compute, or the injected failure (Options::fail_gemm_after).
  absl::Status Gemm(CublasLtLmHead& gemm, const void* a, int64_t n, float* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The GEMM and statistics of `n` device rows at `hidden` (raw dtype
  /// `dtype`), the rows [row0, row0 + n) of the uploaded ids, as chunk
  /// number k (its parity picks the logits buffer); first waits for
  /// w.uploaded[upload] when upload >= 0. Records go to w.records; queued on
  /// compute_ (GEMM) and stats_ (statistics).
  absl::Status GemmAndStatsChunk(Workspace& w, CublasLtLmHead& gemm, const char* hidden, DType dtype, int64_t row0,
                                 int64_t n, int64_t G, int64_t k, int64_t upload, int64_t vocab_begin,
                                 const kernels::StatsSpec& spec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Reserves every buffer the item's passes use, on w (before AgreeOnPass).
  absl::Status ReserveItem(Workspace& w, const CublasLtLmHead& gemm, const HiddenItemRows& item, int me,
                           const OnePassLayout& layout, const kernels::StatsSpec& spec) const;
  /// One pass of a one-pass item (worker/scoring/one_pass_layout.h): upload,
  /// agreement (failure, or cancellation when `check_stop`), all-gather,
  /// GEMMs and statistics, agreement, record all-to-all, download into
  /// `own_records` ([W][item.count[me]][words]).
  absl::Status RunPass(Workspace& w, CublasLtLmHead& gemm, const HiddenItemRows& item, Communicator& comm,
                       const PassLayout& pass, bool check_stop, const kernels::StatsSpec& spec, uint32_t* own_records)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(item_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after Create (the stream and event handles too; the work
  // queued on them happens under mu_).
  int device_ = 0;
  Options options_;
  Stream compute_, copy_, stats_;
  /// cudaHostRegister's read-only flag is supported (queried once).
  bool read_only_register_ = false;
  /// GEMMs done (Options::fail_gemm_after).
  std::atomic<int64_t> gemms_{0};

  /// The stream lock: work is queued on the three streams under it, and it
  /// guards ws_, which the calls other than HiddenItemPartials reuse.
  mutable absl::Mutex mu_;
  Workspace ws_ ABSL_GUARDED_BY(mu_);
  /// One one-pass item at a time (the front-end runs hidden-states plans
  /// one at a time anyway); guards item_ws_.
  absl::Mutex item_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  Workspace item_ws_ ABSL_GUARDED_BY(item_mu_);

  /// Page-locked host ranges (RegisterHostMemory): start -> bytes.
  mutable absl::Mutex reg_mu_;
  std::map<const char*, size_t> registered_ ABSL_GUARDED_BY(reg_mu_);
  bool register_failed_ ABSL_GUARDED_BY(reg_mu_) = false;
};

}  // namespace logprob::cuda
