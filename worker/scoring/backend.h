// The compute seam of the worker: what a backend (CPU, CUDA) does for a
// work item's rows. There are two contracts between the scorer
// (worker/scoring/scorer.cc) and a backend:
//
// 1. The round path (every backend, every layout). The scorer keeps the
//    orchestration: it cuts the item into rounds of rows, runs the
//    collectives (all-gather of hidden states, all-to-all of records) on the
//    host through its Communicator, and combines records with
//    CombinePartials on the host in float64. The backend only turns one
//    block of host rows into packed partial records
//    (worker/kernels/partial_record.h): SlicePartials (logits slices),
//    FilteredRowPartials (full rows with sampling filters), HiddenPartials
//    (hidden states times its lm_head slice, fused) and HiddenLogits (the
//    filtered hidden-states path, which exchanges full rows).
// 2. The one-pass path (HIDDEN_STATES without sampling filters, when
//    OnePassHidden(comm): the CUDA backend with one rank or with device
//    collectives, CanScoreInOnePass in common/input_kind.h; CUDA workers
//    always have them: NCCL's, or Gloo's staged through host memory,
//    worker/comm/host_staged_device_collectives.h). The backend
//    owns the whole item: HiddenItemPartials gathers every rank's rows,
//    multiplies and exchanges the records on its device, and hands the
//    scorer only this rank's rows' records, which it combines as in (1).
//    Payloads in device memory (CUDA IPC inputs) can only take this path.
//
// Either way the big data (logits, GEMM output) stays where the backend
// computes: on the GPU for the CUDA backend.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/error_reason.h"
#include "common/host_bytes.h"
#include "common/lm_head_precision.h"
#include "common/lm_head_transform.h"
#include "worker/comm/communicator.h"
#include "worker/comm/host_staged_device_collectives.h"
#include "worker/kernels/head_backward.h"
#include "worker/kernels/row_stats.h"
#include "worker/scoring/slice_backward.h"
#include "worker/scoring/slice_distillation.h"

namespace logprob {

/// The rows of one block, in the block's row order.
struct BlockRows {
  int64_t count = 0;
  const int64_t* targets = nullptr;     // [count] global ids; < 0: no target
  const int64_t* gather_ids = nullptr;  // [count, spec.gather_k] global ids (null when gather_k == 0)
  /// Sampling masks (WorkItem.masked / mask_offsets / mask_ids; docs/SPEC.md
  /// "Sampling masks"): null when the rows have none. Row i keeps the ids
  /// mask_ids[mask_begin[i], mask_end[i]) when mask_begin[i] >= 0 (none of
  /// them may be in this slice), and is unmasked when mask_begin[i] < 0.
  const int64_t* mask_begin = nullptr;  // [count]
  const int64_t* mask_end = nullptr;    // [count]
  const int32_t* mask_ids = nullptr;
};

/// A block of logits in host memory: rows.count rows of `len` elements of
/// `dtype` (row-major, row stride `len`), global columns
/// [vocab_begin, vocab_begin + len).
struct LogitsBlock {
  DType dtype = v1::F32;
  const void* data = nullptr;
  int64_t vocab_begin = 0;
  int64_t len = 0;
};

/// Sampling filters of a job (docs/SPEC.md "Filters"): top-k (0 or >= V
/// disables) then top-p (outside (0, 1) disables).
struct SamplingFilter {
  int top_k = 0;
  float top_p = 1.0f;
};

/// A worker's lm_head vocabulary slice as read from the checkpoint: rows
/// [vocab_begin, vocab_end) of the [V, H] weight, row-major, `dtype` F32,
/// BF16 or F16: a copy, or a read-only mapping of an in-memory store file
/// (HostBytes::MapMemoryFile). With the head's logit transform
/// (common/lm_head_transform.h): its scalars, and when transform.has_bias
/// the slice's bias elements [vocab_begin, vocab_end) widened to f32
/// (`bias`, rows floats; empty without a bias).
struct LmHeadSlice {
  DType dtype = v1::BF16;
  HostBytes weight;
  int64_t rows = 0, hidden_size = 0;
  LmHeadTransform transform;
  std::vector<float> bias;
};

/// INVALID_ARGUMENT unless the slice's transform is well-formed: logit_scale
/// finite and > 0, softcap finite and >= 0, bias.size() == rows when
/// transform.has_bias and 0 otherwise, every bias element finite.
absl::Status CheckLmHeadTransform(const LmHeadSlice& slice);

/// One lm_head vocabulary slice loaded into a backend (ScoringBackend::
/// LoadLmHead), in the form its GEMM multiplies by: oneDNN-ready host
/// memory on the CPU, device memory on a GPU. Immutable after loading;
/// a worker holds one per servable (head, version) and hands the one a work
/// item names to the hidden-states calls. Freed when the last holder (the
/// worker's LmHeadRegistry, an item that is scoring) lets it go.
class LmHeadWeights {
 public:
  virtual ~LmHeadWeights() = default;
  int64_t rows() const { return rows_; }                // N: the vocabulary slice's length
  int64_t hidden_size() const { return hidden_size_; }  // H
  /// What the head does to h W^T (the backend applies it to its GEMM
  /// output, element-wise, before any statistics or returned logits).
  const LmHeadTransform& transform() const { return transform_; }
  /// The slice's bias, f32 host memory: [rows()] when transform().has_bias,
  /// else empty.
  const std::vector<float>& bias() const { return bias_; }
  /// Bytes the backend holds for it (host or device).
  virtual size_t bytes() const = 0;
  /// How its GEMM multiplies, for the load's log line (e.g. "oneDNN f32
  /// GEMM, bf16 operands, F32 weights converted per tile"); empty: not said.
  virtual std::string Describe() const { return {}; }

 protected:
  LmHeadWeights(int64_t rows, int64_t hidden_size, LmHeadTransform transform = {}, std::vector<float> bias = {})
      : rows_(rows), hidden_size_(hidden_size), transform_(transform), bias_(std::move(bias)) {}

 private:
  const int64_t rows_, hidden_size_;
  const LmHeadTransform transform_;
  const std::vector<float> bias_;
};

/// A whole HIDDEN_STATES work item as one rank sees it, for a backend that
/// scores it in one pass (ScoringBackend::HiddenItemPartials). The item's
/// rows are split over the W ranks in rank order: rank q holds item rows
/// [first[q], first[q] + count[q]) (first[0] == 0, first[q + 1] ==
/// first[q] + count[q]).
struct HiddenItemRows {
  DType dtype = v1::BF16;             // of the hidden states (F32, BF16 or F16)
  const void* own = nullptr;          // this rank's rows: [count[rank], H] row-major
  bool own_on_device = false;         // `own` is in this backend's device memory (a CUDA IPC input), else host memory
  int64_t vocab_begin = 0;            // global id of the lm_head slice's first row
  std::vector<int64_t> first, count;  // per rank
  BlockRows rows;                     // targets (and gather ids) of all item rows, in item order
  /// Polled between passes (null: never stop); the ranks agree, so all
  /// stop after the same pass and HiddenItemPartials returns CANCELLED.
  std::function<bool()> should_stop;
};

/// Device memory of an item's payload that a backend mapped (a same-host
/// client's CUDA IPC allocation); unmapped when the last copy goes.
using DevicePayload = std::shared_ptr<const char>;

/// The error of a hidden-states item naming an lm_head version the worker
/// does not hold (FAILED_PRECONDITION, reason LM_HEAD_VERSION_UNAVAILABLE,
/// which reaches the client unchanged).
inline absl::Status NoLmHeadError(const std::string& head, const std::string& version) {
  return WithReason(absl::FailedPreconditionError(
                        absl::StrCat("work item: this worker holds no lm_head '", head, "' version '", version, "'")),
                    v1::LM_HEAD_VERSION_UNAVAILABLE);
}

/// Produces packed partial records (kernels::PartialWords(spec) uint32
/// words per row, the layout of kernels::ComputePartial) for blocks of
/// rows. Records of a row over all vocabulary slices combine with
/// kernels::CombinePartials. Implementations must allow concurrent calls
/// from several threads (token-parallel items run concurrently).
class ScoringBackend {
 public:
  virtual ~ScoringBackend() = default;

  /// "cpu" or "cuda".
  virtual std::string name() const = 0;

  /// Records of rows.count rows of the logits slice `block`, without
  /// filters. `records` holds rows.count * PartialWords(spec) words.
  virtual absl::Status SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                     uint32_t* records) = 0;

  /// Records of rows.count full rows (block.vocab_begin == 0, block.len ==
  /// V) with sampling filters: x = logits / spec.temperature, the filter's
  /// smallest kept x (kernels::SamplingKeepMin) per row, then the record
  /// with everything below it removed.
  virtual absl::Status FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows,
                                           const kernels::StatsSpec& spec, const SamplingFilter& filter,
                                           uint32_t* records) = 0;

  /// Memory in use on this backend's GPU, bytes (cudaMemGetInfo: total -
  /// free, all processes on the device); 0 for host backends or on error.
  /// Reported per work item (metric logprob_gpu_memory_bytes).
  virtual int64_t device_memory_bytes() const { return 0; }

  /// True once the backend's device is broken for good (a sticky CUDA
  /// error: illegal address, launch failure, ECC, ...): every later item
  /// would fail, so the worker answers UNAVAILABLE and its pool re-forms
  /// with a fresh process. False for host backends. Thread-safe.
  virtual bool device_lost() const { return false; }

  /// Loads an lm_head slice (its weight is moved from) for the hidden-states
  /// calls below: the GEMM's operands in `precision`
  /// (common/lm_head_precision.h), uploaded to the device on a GPU.
  /// INVALID_ARGUMENT for a bad slice (kernels::CheckLmHeadWeight);
  /// RESOURCE_EXHAUSTED / INTERNAL when the memory cannot be had.
  /// Thread-safe; may run while items are scored.
  virtual absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice slice,
                                                                          LmHeadPrecision precision) = 0;

  /// Fused hidden-states path: records of rows.count hidden-state rows
  /// `hidden` ([rows.count, H] of `hidden_dtype`, host memory) times the
  /// lm_head slice `lm_head` (LoadLmHead of this backend), whose first
  /// column is global id `vocab_begin`, with the head's transform applied
  /// (lm_head.transform(): the logits are softcap(scale * (h W^T + b))). The logits exist only inside the
  /// backend, a chunk at a time.
  virtual absl::Status HiddenPartials(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden,
                                      int64_t vocab_begin, const BlockRows& rows, const kernels::StatsSpec& spec,
                                      uint32_t* records) = 0;

  /// logits[M, lm_head.rows()] (f32, host memory) = the head's transform of
  /// hidden[M, H] @ slice^T (as HiddenPartials), for the filtered
  /// hidden-states path, which exchanges full rows.
  virtual absl::Status HiddenLogits(const LmHeadWeights& lm_head, DType hidden_dtype, const void* hidden, int64_t M,
                                    float* logits) = 0;

  /// The lm_head's backward over the slice `lm_head` (LoadLmHead of this
  /// backend) whose first row is global id `vocab_begin`, at
  /// `temperature` (slice_backward.h; the math:
  /// worker/kernels/head_backward.h): it recomputes the logits with the
  /// slice's own GEMM, so its probabilities are the forward's bits. One per
  /// work item; it uses the slice's GEMM, so runs under the worker's
  /// collective lock. FAILED_PRECONDITION on a backend without one (the
  /// default).
  virtual absl::StatusOr<std::unique_ptr<SliceBackward>> HeadBackward(const LmHeadWeights& lm_head, int64_t vocab_begin,
                                                                      float temperature);

  /// Full-vocabulary distillation over the same vocabulary slice of two
  /// heads (LoadLmHead of this backend), `student` (which gets gradients)
  /// and `teacher`, whose first row is global id `vocab_begin`, at
  /// `temperature` (slice_distillation.h; the math:
  /// worker/kernels/divergence.h). One per work item; it uses both slices'
  /// GEMMs, so runs under the worker's collective lock. INVALID_ARGUMENT
  /// when the slices' rows differ; FAILED_PRECONDITION on a backend
  /// without one (the default).
  virtual absl::StatusOr<std::unique_ptr<SliceDistillation>> HeadDistillation(const LmHeadWeights& student,
                                                                              const LmHeadWeights& teacher,
                                                                              int64_t vocab_begin, float temperature);

  /// True when HiddenItemPartials scores a HIDDEN_STATES item over `comm`
  /// in one pass (the CUDA backend with W == 1 or device collectives);
  /// false: the scorer runs rounds of --hidden-chunk-tokens rows (the CPU
  /// backend, whose memory those rounds bound).
  virtual bool OnePassHidden(const Communicator& /*comm*/) const { return false; }

  /// One-pass fused hidden-states path, without sampling filters: gathers
  /// every rank's rows (`comm`), multiplies all of them by this rank's
  /// lm_head slice in chunks sized by the backend's memory budget, computes
  /// the packed record (kernels::PartialWords(spec) words) of every item
  /// row, and exchanges the records so that `own_records` receives, for
  /// this rank's count[rank] rows, the records of every rank's vocabulary
  /// slice: [W][count[rank]][words], rank-major, as one all-to-all of the
  /// round path delivers them. Every rank calls it with the same item.
  /// UNIMPLEMENTED when OnePassHidden(comm) is false; INVALID_ARGUMENT for
  /// an inconsistent item; UNAVAILABLE / DEADLINE_EXCEEDED when a
  /// collective fails.
  virtual absl::Status HiddenItemPartials(const LmHeadWeights& lm_head, const HiddenItemRows& item, Communicator& comm,
                                          const kernels::StatsSpec& spec, uint32_t* own_records);

  /// Host memory the backend may read from directly until
  /// UnregisterHostMemory(data): the front-end's payload regions, mapped
  /// read-only by the worker. The CUDA backend page-locks it
  /// (cudaHostRegister) so uploads from it skip the staging copy. Failure
  /// only loses that speed-up. Default: nothing. Thread-safe.
  virtual void RegisterHostMemory(const void* /*data*/, size_t /*bytes*/) {}
  virtual void UnregisterHostMemory(const void* /*data*/) {}

  /// Maps `bytes` bytes at `offset` of a same-host client's CUDA allocation
  /// exported with cudaIpcGetMemHandle (`handle`: the 64-byte
  /// cudaIpcMemHandle_t) into this backend's device memory;
  /// `allocation_bytes` is the allocation's size the client sent (0: not
  /// given), which bounds the range (CudaIpcRangeLimit).
  /// FAILED_PRECONDITION on backends without a GPU (the default) or when
  /// the handle cannot be opened; INVALID_ARGUMENT for a bad handle size or
  /// a range outside the allocation.
  virtual absl::StatusOr<DevicePayload> OpenCudaIpcPayload(std::string_view handle, int64_t offset, int64_t bytes,
                                                           int64_t allocation_bytes);

  /// A new DeviceCopy between host memory and this backend's device memory
  /// (the CUDA backend: cuda::CudaDeviceCopy on its device, with a stream
  /// of its own), for copies outside work items (the rows of an lm_head
  /// update staged from a CUDA IPC handle: worker/heads/device_file_copy.h).
  /// FAILED_PRECONDITION on backends without a GPU (the default);
  /// INTERNAL when the stream cannot be created. Thread-safe.
  virtual absl::StatusOr<std::unique_ptr<DeviceCopy>> NewDeviceCopy();
};

}  // namespace logprob
