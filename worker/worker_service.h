// The worker's gRPC data plane (internal Worker service).
#pragma once

#include <memory>

#include "absl/synchronization/mutex.h"
#include "common/internal_auth.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "worker/comm/communicator.h"
#include "worker/gradients/head_gradient_steps.h"
#include "worker/heads/lm_head_registry.h"
#include "worker/scoring/backend.h"
#include "worker/scoring/payload_regions.h"
#include "worker/scoring/scorer.h"
#include "worker/stop_signals.h"

namespace logprob {

/// Who may call a worker and which items it takes (what the front-end's
/// JoinReply said).
struct WorkerAdmission {
  /// Checked first by every method (UNAUTHENTICATED without the pool
  /// secret). Insecure: a unit test calling the handlers directly.
  InternalAuth auth = InternalAuth::Insecure();
  /// The pool generation this worker belongs to: a Run call must carry it
  /// (kGenerationMetadataKey), else FAILED_PRECONDITION before anything is
  /// opened. -1: not checked (unit tests).
  int64_t generation = -1;
  /// JoinReply.payload_region_prefix: the only shared-memory names opened.
  std::string payload_region_prefix;
  /// JoinReply.lm_head_store_dir: the only folder StageLmHeadRows writes
  /// in (empty: staging refused).
  std::string lm_head_store_dir;
  /// The gradient steps' budget and idle timeout (JoinReply
  /// gradient_step_bytes / gradient_step_timeout_seconds).
  HeadGradientSteps::Options gradient_steps{int64_t{2} << 30, absl::Minutes(10)};
};

/// Serves Run (score a WorkItem), Info, LoadLmHead / DropLmHead (the
/// lm_head versions of `lm_heads`, which hidden-states items name) and
/// StageLmHeadRows (update rows from a CUDA IPC handle into a file). Vocab-parallel and
/// hidden-states items use the communicator and run one at a time (the
/// front-end sends them in the same order to every rank); token-parallel
/// items run concurrently. A HIDDEN_STATES item from a CUDA IPC input
/// (WorkItem.cuda_ipc) is mapped on the backend's GPU. The ranks of a
/// collective item agree that all of them opened its payload and hold its
/// lm_head before scoring, and stop together (Stop, or a cancelled call)
/// at the same round.
class WorkerService final : public internal::v1::Worker::Service {
 public:
  /// `backend` computes every item; `lm_heads` (loaded into `backend`,
  /// which must outlive it) holds the lm_head slices hidden-states items
  /// name; `chunk_tokens`: hidden-states rows per rank per round.
  WorkerService(std::unique_ptr<Communicator> comm, std::unique_ptr<ScoringBackend> backend,
                std::unique_ptr<LmHeadRegistry> lm_heads, int64_t chunk_tokens = kDefaultHiddenChunkTokens,
                WorkerAdmission admission = WorkerAdmission())
      : backend_(std::move(backend)),
        comm_(std::move(comm)),
        lm_heads_(std::move(lm_heads)),
        chunk_tokens_(chunk_tokens),
        admission_(std::move(admission)),
        payload_regions_(8, backend_.get(), admission_.payload_region_prefix),
        gradient_steps_(admission_.gradient_steps) {
    CheckCallersBeforeReading();
  }
  /// Every method first checks the caller (Admission::auth). Scores one
  /// work item. Errors: UNAUTHENTICATED without the pool secret;
  /// FAILED_PRECONDITION for an item of another pool generation; the
  /// item's (INVALID_ARGUMENT, CANCELLED, ...); UNAVAILABLE whenever the backend's device is lost
  /// (ScoringBackend::device_lost: a sticky CUDA error), so that the
  /// front-end re-forms the pool. Thread-safe.
  grpc::Status Run(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                   internal::v1::WorkResult* result) override;
  /// Marks a run stopped: its items (running or not yet started) end
  /// CANCELLED at their next stop check.
  grpc::Status Stop(grpc::ServerContext* ctx, const internal::v1::StopRequest* req,
                    internal::v1::StopReply* reply) override;
  grpc::Status Info(grpc::ServerContext* ctx, const internal::v1::WorkerInfoRequest* req,
                    internal::v1::WorkerInfoReply* reply) override;
  grpc::Status LoadLmHead(grpc::ServerContext* ctx, const internal::v1::LmHeadLoad* req,
                          internal::v1::LoadLmHeadReply* reply) override;
  grpc::Status DropLmHead(grpc::ServerContext* ctx, const internal::v1::LmHeadRef* req,
                          internal::v1::DropLmHeadReply* reply) override;
  /// Copies an lm_head update's rows from a same-host client's GPU memory
  /// (req->source, a CUDA IPC reference) into the staged store file
  /// req->file at req->file_offset (StageLmHeadRows below). Concurrent
  /// calls are fine (each maps the handle and copies on its own stream).
  grpc::Status StageLmHeadRows(grpc::ServerContext* ctx, const internal::v1::LmHeadStage* req,
                               internal::v1::LmHeadStageReply* reply) override;
  /// A piece of a gradient step's sums on this worker's slice, and a
  /// step's close (HeadGradientSteps::Read / Close). Thread-safe.
  grpc::Status ReadHeadGradients(grpc::ServerContext* ctx, const internal::v1::WorkerHeadGradientsRequest* req,
                                 v1::HeadGradientsChunk* reply) override;
  grpc::Status CloseHeadGradientStep(grpc::ServerContext* ctx, const v1::CloseHeadGradientStepRequest* req,
                                     v1::CloseHeadGradientStepResponse* reply) override;

 private:
  /// Serves every method with its caller checked (admission_.auth) before
  /// the request's body is read (NewCheckedUnaryHandler): a caller without
  /// the pool secret gets UNAUTHENTICATED without the worker allocating its
  /// message, however large.
  void CheckCallersBeforeReading();
  /// Run without the device-lost check (see Run).
  grpc::Status RunItem(grpc::ServerContext* ctx, const internal::v1::WorkItem* item, internal::v1::WorkResult* result);
  /// The payload of `item`: its bytes field, its range of the front-end's
  /// shared memory (*region keeps it mapped), or its range of a same-host
  /// client's CUDA allocation (WorkItem.cuda_ipc, mapped by the
  /// backend; *device keeps it mapped). Errors of PayloadRegions::Payload
  /// and ScoringBackend::OpenCudaIpcPayload.
  absl::StatusOr<ItemPayload> OpenPayload(const internal::v1::WorkItem& item, std::shared_ptr<SharedRegion>* region,
                                          DevicePayload* device);

  // The communicator may use the backend's stream (NCCL): it goes first.
  std::unique_ptr<ScoringBackend> backend_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<LmHeadRegistry> lm_heads_;
  int64_t chunk_tokens_;
  const WorkerAdmission admission_;
  absl::Mutex collective_mu_;  // one work item's collective sequence at a time
  StopSignals stops_;
  // Declared after backend_: unmapped (and unregistered from it) first.
  PayloadRegions payload_regions_;
  // The lm_head gradient sums of the optimizer steps backward items name.
  HeadGradientSteps gradient_steps_;
};

/// What Worker.StageLmHeadRows does on `backend`: first checks that
/// stage.file is a staged file ("<name>.partial") directly in `store_dir`
/// (JoinReply.lm_head_store_dir; common/lm_head_store_name.h) and opens it
/// there without following links, then checks `stage` (a
/// non-negative offset and size, a range inside the existing file
/// stage.file, which it neither creates nor extends), takes a DeviceCopy
/// (ScoringBackend::NewDeviceCopy), maps the CUDA IPC reference
/// (ScoringBackend::OpenCudaIpcPayload) and copies it into the file
/// (CopyDeviceToFile). Returns the bytes written (all of them). Errors:
/// FAILED_PRECONDITION on a backend without a GPU or a handle it cannot
/// open; INVALID_ARGUMENT for a bad range (of the file or the
/// allocation); PERMISSION_DENIED for a file that is not a staged file of
/// `store_dir` (or an empty `store_dir`), before anything is opened;
/// NOT_FOUND when the file cannot be opened (a link included);
/// FAILED_PRECONDITION for a name that is not a regular file (a FIFO is
/// never waited on);
/// CopyDeviceToFile's errors. Thread-safe.
absl::StatusOr<int64_t> StageLmHeadRows(ScoringBackend& backend, const internal::v1::LmHeadStage& stage,
                                        const std::string& store_dir);

}  // namespace logprob
