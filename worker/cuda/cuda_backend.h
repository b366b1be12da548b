// The CUDA backend: the row kernels (row_partials.cu, sampling_filter.cu)
// and the cuBLASLt lm_head GEMM behind ScoringBackend. Logits and GEMM
// output stay on the device; only the packed partial records come back.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/input_kind.h"
#include "worker/backend.h"
#include "worker/cuda/device_buffers.h"
#include "worker/cuda/lm_head_gemm_cublaslt.h"
#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {

/// CUDA implementation of ScoringBackend on one device. Calls are
/// serialised by a mutex (one device, one compute stream); host logits
/// blocks are staged through two pinned buffers so the host copy of one
/// sub-block and its upload (copy stream) overlap the kernels of the
/// previous one (compute stream).
/// An lm_head slice in this backend's device memory: its cuBLASLt GEMM.
class CudaLmHead final : public LmHeadWeights {
 public:
  explicit CudaLmHead(std::unique_ptr<CublasLtLmHead> gemm)
      : LmHeadWeights(gemm->rows(), gemm->hidden_size()), gemm_(std::move(gemm)) {}
  size_t bytes() const override { return gemm_->weight_bytes(); }
  /// Used under the backend's call lock (one GEMM at a time).
  CublasLtLmHead& gemm() const { return *gemm_; }

 private:
  std::unique_ptr<CublasLtLmHead> gemm_;
};

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
  };

  /// Uses `device` (made current); lm_heads come later (LoadLmHead).
  /// FAILED_PRECONDITION without a usable device; INTERNAL for CUDA
  /// failures.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device, const Options& options);
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device) { return Create(device, Options()); }

  std::string name() const override { return "cuda"; }
  int64_t device_memory_bytes() const override;
  absl::Status SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                             uint32_t* records) override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                   const SamplingFilter& filter, uint32_t* records) override ABSL_LOCKS_EXCLUDED(mu_);
  /// Uploads the slice to this device as the cuBLASLt GEMM's operand (one
  /// algorithm for every M, chosen for the usual chunk). Does not wait for
  /// the calls in progress.
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice slice,
                                                                  LmHeadPrecision precision) override;
  absl::Status HiddenPartials(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t vocab_begin,
                              const BlockRows& rows, const kernels::StatsSpec& spec, uint32_t* records) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status HiddenLogits(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t M,
                            float* logits) override ABSL_LOCKS_EXCLUDED(mu_);
  /// One pass needs no host bounce: W == 1, or NCCL's device collectives
  /// (CanScoreInOnePass, the front-end's rule too).
  bool OnePassHidden(const Communicator& comm) const override {
    return CanScoreInOnePass(comm.size(), comm.device_collectives());
  }
  /// The whole item on the device: this rank's rows are uploaded in GEMM
  /// chunks on the copy stream (straight from page-locked or device memory,
  /// else through the two pinned staging buffers), all-gathered in place
  /// over NCCL (W >= 2), multiplied chunk by chunk on the compute stream
  /// into two alternating logits buffers while the statistics kernel of the
  /// previous chunk runs on a second stream, and the records, which stay on
  /// the device, are exchanged with one device all-to-all; only this rank's
  /// rows' records come back to the host. Every row runs the same GEMM
  /// algorithm and kernels whatever M and its position (batch invariance).
  absl::Status HiddenItemPartials(const LmHeadWeights& lm_head, const HiddenItemRows& item, Communicator& comm,
                                  const kernels::StatsSpec& spec, uint32_t* own_records) override
      ABSL_LOCKS_EXCLUDED(mu_);
  /// cudaHostRegister (read-only, portable) of a payload region; failures
  /// are logged once and leave uploads on the staging path.
  void RegisterHostMemory(const void* data, size_t bytes) override ABSL_LOCKS_EXCLUDED(reg_mu_);
  void UnregisterHostMemory(const void* data) override ABSL_LOCKS_EXCLUDED(reg_mu_);
  /// cuda::OpenCudaIpc on this backend's device (worker/cuda/cuda_ipc.h).
  absl::StatusOr<DevicePayload> OpenCudaIpcPayload(std::string_view handle, int64_t offset, int64_t bytes) override;

  int device() const { return device_; }
  /// The compute stream (the NCCL communicator may run its collectives on it).
  cudaStream_t stream() const { return compute_.get(); }

 private:
  CudaBackend() = default;
  absl::Status LogitsPartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                              const SamplingFilter* filter, uint32_t* records) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status UploadIds(const BlockRows& rows, const kernels::StatsSpec& spec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Points gemm_ at an lm_head's GEMM for one call, made under mu_.
  class UsingLmHead {
   public:
    UsingLmHead(CudaBackend* b, const LmHeadWeights& lm_head) ABSL_EXCLUSIVE_LOCKS_REQUIRED(b->mu_) : b_(b) {
      b_->gemm_ = &static_cast<const CudaLmHead&>(lm_head).gemm();
    }
    ~UsingLmHead() ABSL_NO_THREAD_SAFETY_ANALYSIS { b_->gemm_ = nullptr; }
    UsingLmHead(const UsingLmHead&) = delete;
    UsingLmHead& operator=(const UsingLmHead&) = delete;

   private:
    CudaBackend* b_;
  };
  int64_t GemmChunkRows(int64_t M) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Points `args` at rows [r0, r0 + n) of the uploaded ids and the records.
  void PointAtRows(int64_t r0, int64_t n, const kernels::StatsSpec& spec, RowBlockArgs* args) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FetchRecords(int64_t rows, const kernels::StatsSpec& spec, uint32_t* records)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Copies `bytes` from device memory `src` to host `dst` through the
  /// pinned records buffer, after the compute stream's queued work.
  absl::Status Download(const void* src, size_t bytes, void* dst) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// True when [data, data + bytes) lies in one registered host range, or
  /// both its ends are page-locked host memory (cudaPointerGetAttributes):
  /// uploads from it need no staging copy.
  bool IsPageLocked(const void* data, size_t bytes) const ABSL_LOCKS_EXCLUDED(reg_mu_);
  /// Queues the upload of `rows` rows of `row_bytes` at `src` (host or, with
  /// `on_device`, device memory) to `dst` on the copy stream in chunks of
  /// `chunk_rows`, recording uploaded_[c] after chunk c.
  absl::Status UploadRows(const char* src, bool on_device, int64_t rows, size_t row_bytes, int64_t chunk_rows,
                          char* dst) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The GEMM operand of rows [l0, l0 + n) of `hidden` (device, raw dtype
  /// `dtype`, chunks of G rows): after uploaded_[l0 / G] when
  /// `wait_uploads`, converted into hidden_dev_ on the compute stream when
  /// `dtype` is not the GEMM's compute dtype.
  absl::StatusOr<const void*> ChunkOperand(const char* hidden, DType dtype, int64_t l0, int64_t n, int64_t G,
                                           bool wait_uploads) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The GEMM and statistics of `rows` device rows at `hidden` (raw dtype
  /// `dtype`), the rows [row0, row0 + rows) of the uploaded ids, in chunks
  /// of G rows numbered from k0 (chunk parity picks the logits buffer);
  /// `wait_uploads`: chunk c first waits for uploaded_[c]. Records go to
  /// records_dev_; queued on compute_ (GEMM) and stats_ (statistics).
  /// Returns the next chunk number.
  absl::StatusOr<int64_t> GemmAndStats(const char* hidden, DType dtype, int64_t row0, int64_t rows, int64_t G,
                                       int64_t k0, bool wait_uploads, int64_t vocab_begin,
                                       const kernels::StatsSpec& spec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after Create (the stream and event handles too; the work
  // queued on them, and the GEMMs, happen under mu_).
  int device_ = 0;
  Options options_;
  Stream compute_, copy_, stats_;
  Event copied_[2], computed_[2], gemm_done_[2], stats_done_[2];

  /// Serialises the calls: one device, one compute stream, and the
  /// buffers below, which every call reuses.
  absl::Mutex mu_;
  // Guarded by mu_.
  /// The lm_head of the hidden-states call in progress (its LmHeadWeights).
  CublasLtLmHead* gemm_ ABSL_GUARDED_BY(mu_) = nullptr;
  PinnedBuffer staging_host_[2] ABSL_GUARDED_BY(mu_);
  PinnedBuffer records_host_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer staging_dev_[2] ABSL_GUARDED_BY(mu_);
  DeviceBuffer hidden_raw_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer hidden_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer logits_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer targets_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer gather_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer keep_min_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer records_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer topk_x_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer topk_id_dev_ ABSL_GUARDED_BY(mu_);
  DeviceBuffer chunk_logits_[2] ABSL_GUARDED_BY(mu_);                  // one-pass: alternating GEMM outputs
  DeviceBuffer exchanged_dev_ ABSL_GUARDED_BY(mu_);                    // one-pass: records after the all-to-all
  std::vector<std::unique_ptr<Event>> uploaded_ ABSL_GUARDED_BY(mu_);  // one-pass: per upload chunk

  /// Page-locked host ranges (RegisterHostMemory): start -> bytes.
  mutable absl::Mutex reg_mu_;
  std::map<const char*, size_t> registered_ ABSL_GUARDED_BY(reg_mu_);
  bool register_failed_ ABSL_GUARDED_BY(reg_mu_) = false;
};

}  // namespace logprob::cuda
