#include "worker/worker_service.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/lm_head_store_name.h"
#include "common/parsed_requests.h"
#include "common/worker_protocol.h"
#include "worker/comm/timed_communicator.h"
#include "worker/gradients/backward_item.h"
#include "worker/gradients/distillation_item.h"
#include "worker/heads/device_file_copy.h"
#include "worker/scoring/scorer.h"

namespace logprob {
namespace {

/// `st`, an error opening or taking a client's CUDA IPC reference on this
/// worker, with reason CUDA_IPC_UNAVAILABLE when it says the reference
/// cannot be served here (FAILED_PRECONDITION: no GPU, a handle the driver
/// will not map): the client then sends the bytes. A malformed reference
/// (INVALID_ARGUMENT) keeps no reason.
absl::Status CudaIpcRefused(absl::Status st) {
  return st.code() == absl::StatusCode::kFailedPrecondition ? WithReason(std::move(st), v1::CUDA_IPC_UNAVAILABLE) : st;
}

/// OK when every rank runs an item of the same run `run` (the front-end's
/// kRunIdMetadataKey: one per plan it sends to every rank) and every rank's
/// `mine` is OK (one 16-byte all-gather). Else FAILED_PRECONDITION on every
/// rank when the runs differ (the ranks are not on the same item: one the
/// plan did not send to all of them; none runs it, no rank crashes), this
/// rank's error, or FAILED_PRECONDITION naming the first rank that failed.
/// The ranks of a collective item agree on it before the item's
/// collectives, so one rank failing to open its payload (a CUDA IPC
/// mapping, a shared-memory range) or lacking the lm_head does not leave
/// the others waiting.
absl::Status AllRanksOk(Communicator& comm, const absl::Status& mine, uint64_t run) {
  struct Entry {
    uint64_t failed, run;
  };
  const Entry me{mine.ok() ? 0u : 1u, run};
  std::vector<Entry> all(static_cast<size_t>(comm.size()));
  if (absl::Status st = comm.AllGather(&me, sizeof(Entry), all.data()); !st.ok()) return st;
  for (int q = 0; q < comm.size(); ++q)
    if (all[q].run != run)
      return absl::FailedPreconditionError(absl::StrCat("worker rank ", q, " runs an item of run ", all[q].run,
                                                        " while this rank (", comm.rank(), ") runs one of run ", run,
                                                        ": the ranks are not on the same item; every rank refuses it"));
  if (!mine.ok()) return mine;
  for (int q = 0; q < comm.size(); ++q)
    if (all[q].failed)
      return absl::FailedPreconditionError(
          absl::StrCat("worker rank ", q, " could not start its part of the item (its reply says why)"));
  return absl::OkStatus();
}

/// The decimal number the front-end put in the call's metadata under
/// `key`, or nullopt (none, or not a number: e.g. a test's call).
template <typename T>
std::optional<T> MetadataNumber(const grpc::ServerContext& ctx, const char* key) {
  const auto& md = ctx.client_metadata();
  const auto it = md.find(key);
  T value = 0;
  if (it == md.end() || !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &value))
    return std::nullopt;
  return value;
}

/// The run id of a Run call (kRunIdMetadataKey).
std::optional<uint64_t> RunId(const grpc::ServerContext& ctx) {
  return MetadataNumber<uint64_t>(ctx, kRunIdMetadataKey);
}

/// The pool generation of a Run call (kGenerationMetadataKey).
std::optional<int64_t> Generation(const grpc::ServerContext& ctx) {
  return MetadataNumber<int64_t>(ctx, kGenerationMetadataKey);
}

/// The index of method `name` of the Worker service (proto order).
int WorkerMethodIndex(const char* name) {
  const google::protobuf::ServiceDescriptor* service =
      internal::v1::WorkItem::descriptor()->file()->FindServiceByName("Worker");
  return service->FindMethodByName(name)->index();
}

}  // namespace

void WorkerService::CheckCallersBeforeReading() {
  int installed = 0;
  const auto install = [this, &installed](const char* name, const char* method, auto fn) {
    const InternalAuth* auth = &admission_.auth;
    MarkMethodStreamed(
        WorkerMethodIndex(name),
        NewCheckedUnaryHandler(
            this, method, [auth, method](const grpc::ServerContext& ctx) { return auth->Check(ctx, method); }, fn));
    ++installed;
  };
  install("Run", "Worker.Run", &WorkerService::Run);
  install("Stop", "Worker.Stop", &WorkerService::Stop);
  install("Info", "Worker.Info", &WorkerService::Info);
  install("LoadLmHead", "Worker.LoadLmHead", &WorkerService::LoadLmHead);
  install("DropLmHead", "Worker.DropLmHead", &WorkerService::DropLmHead);
  install("StageLmHeadRows", "Worker.StageLmHeadRows", &WorkerService::StageLmHeadRows);
  install("ReadHeadGradients", "Worker.ReadHeadGradients", &WorkerService::ReadHeadGradients);
  install("CloseHeadGradientStep", "Worker.CloseHeadGradientStep", &WorkerService::CloseHeadGradientStep);
  // A method added to the proto must be installed here too.
  const int methods = internal::v1::WorkItem::descriptor()->file()->FindServiceByName("Worker")->method_count();
  if (installed != methods) {
    std::fprintf(stderr, "logprob-worker: %d of the Worker service's %d methods check their caller first\n", installed,
                 methods);
    std::abort();
  }
}

absl::StatusOr<ItemPayload> WorkerService::OpenPayload(const internal::v1::WorkItem& item,
                                                       std::shared_ptr<SharedRegion>* region, DevicePayload* device) {
  if (item.has_cuda_ipc()) {
    const internal::v1::CudaIpcPayload& ipc = item.cuda_ipc();
    auto opened = backend_->OpenCudaIpcPayload(ipc.handle(), ipc.offset(), ipc.byte_size(), ipc.allocation_bytes());
    if (!opened.ok()) return CudaIpcRefused(opened.status());
    *device = *std::move(opened);
    return ItemPayload(std::string_view(device->get(), static_cast<size_t>(ipc.byte_size())), /*device=*/true);
  }
  auto found = payload_regions_.Payload(item, region);
  if (!found.ok()) return found.status();
  return ItemPayload(*found);
}

grpc::Status WorkerService::Run(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                                internal::v1::WorkResult* result) {
  if (grpc::Status st = admission_.auth.Check(*ctx, "Worker.Run"); !st.ok()) return st;
  // An item the front-end did not plan for this generation (a forged or a
  // stale one) is refused before any payload is opened or collective run.
  if (const std::optional<int64_t> generation = Generation(*ctx);
      admission_.generation >= 0 && generation != admission_.generation)
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("work item of pool generation ", generation.value_or(-1),
                                     "; this worker belongs to generation ", admission_.generation));
  grpc::Status st = RunItem(ctx, item, result);
  // A broken device (a sticky CUDA error, here or in an earlier item)
  // fails every item from now on: UNAVAILABLE makes the front-end re-form
  // the pool, which ends this process's membership (a fresh process joins).
  if (backend_->device_lost() && st.error_code() != grpc::StatusCode::UNAVAILABLE)
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        st.ok() ? std::string("the worker's CUDA device faulted; it leaves the pool")
                                : "the worker's CUDA device faulted; it leaves the pool: " + st.error_message());
  return st;
}

grpc::Status WorkerService::RunItem(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                                    internal::v1::WorkResult* result) {
  // Stopped by the front-end's Stop for this run, or by the call ending
  // (the pool failing, the front-end gone).
  const std::optional<uint64_t> run_id = RunId(*ctx);
  const std::function<bool()> cancelled = [this, ctx, run_id] {
    return ctx->IsCancelled() || (run_id && stops_.Stopped(*run_id));
  };
  // The payload: in the item, in the front-end's shared memory, or (a CUDA
  // IPC input) in a same-host client's GPU allocation, mapped while the
  // item runs.
  std::shared_ptr<SharedRegion> region;
  DevicePayload device;
  const absl::StatusOr<ItemPayload> payload = OpenPayload(*item, &region, &device);
  absl::Status ready = payload.status();
  // Hidden states: the lm_head version the item names, alive until it ends.
  std::shared_ptr<const LmHeadWeights> lm_head, teacher;
  if (item->layout() == internal::v1::HIDDEN_STATES) {
    lm_head = lm_heads_->Find(item->lm_head());
    if (!lm_head && ready.ok()) ready = NoLmHeadError(item->lm_head().name(), item->lm_head().version());
  }
  const bool distillation = item->has_distillation();
  if (distillation && item->layout() == internal::v1::HIDDEN_STATES) {
    const internal::v1::LmHeadRef& t = item->distillation().teacher();
    teacher = lm_heads_->Find(t);
    if (!teacher && ready.ok()) ready = NoLmHeadError(t.name(), t.version());
  }
  absl::StatusOr<internal::v1::WorkResult> res;
  if (item->layout() != internal::v1::TOKEN_PARALLEL) {
    absl::MutexLock lock(&collective_mu_);
    TimedCommunicator timed(*comm_);
    if (absl::Status st = AllRanksOk(timed, ready, run_id.value_or(0)); !st.ok()) return ReplyWithReason(ctx, st);
    if (distillation)
      res = RunDistillationItem(*item, *payload, timed, *backend_, chunk_tokens_, cancelled, lm_head.get(),
                                teacher.get(), gradient_steps_);
    else if (item->backward())
      res =
          RunBackwardItem(*item, *payload, timed, *backend_, chunk_tokens_, cancelled, lm_head.get(), gradient_steps_);
    else res = ScoreWorkItem(*item, *payload, timed, *backend_, chunk_tokens_, cancelled, lm_head.get());
    if (res.ok()) res->set_collective_seconds(timed.seconds());
  } else {
    if (!ready.ok()) return ReplyWithReason(ctx, ready);
    if (distillation || item->backward())
      return ReplyWithReason(
          ctx, absl::InvalidArgumentError("work item: a backward or a distillation takes hidden states, not logits"));
    SelfCommunicator self;
    res = ScoreWorkItem(*item, *payload, self, *backend_, chunk_tokens_, cancelled, lm_head.get());
  }
  if (!res.ok()) return ReplyWithReason(ctx, res.status());
  res->set_device_memory_bytes(backend_->device_memory_bytes());
  *result = std::move(*res);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ReadHeadGradients(grpc::ServerContext* ctx,
                                              const internal::v1::WorkerHeadGradientsRequest* req,
                                              v1::HeadGradientsChunk* reply) {
  absl::StatusOr<HeadGradientSums> sums = gradient_steps_.Read(req->gradient_step(), req->row_begin(), req->row_end());
  if (!sums.ok()) return ReplyWithReason(ctx, sums.status());
  reply->set_row_begin(req->row_begin());
  reply->mutable_weight()->assign(reinterpret_cast<const char*>(sums->weight.data()),
                                  sums->weight.size() * sizeof(float));
  reply->mutable_bias()->assign(reinterpret_cast<const char*>(sums->bias.data()), sums->bias.size() * sizeof(float));
  reply->set_head(sums->head);
  reply->set_head_version(sums->version);
  reply->set_vocab_size(sums->rows);  // the slice's rows; the front-end answers the head's V
  reply->set_hidden_size(sums->hidden_size);
  reply->set_micro_batches(sums->micro_batches);
  reply->set_tokens(sums->tokens);
  reply->set_has_bias(sums->has_bias);
  return grpc::Status::OK;
}

grpc::Status WorkerService::CloseHeadGradientStep(grpc::ServerContext* ctx, const v1::CloseHeadGradientStepRequest* req,
                                                  v1::CloseHeadGradientStepResponse*) {
  if (absl::Status st = gradient_steps_.Close(req->gradient_step()); !st.ok()) return ReplyWithReason(ctx, st);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Stop(grpc::ServerContext* ctx, const internal::v1::StopRequest* req,
                                 internal::v1::StopReply*) {
  if (grpc::Status st = admission_.auth.Check(*ctx, "Worker.Stop"); !st.ok()) return st;
  stops_.Stop(req->run_id());
  return grpc::Status::OK;
}

grpc::Status WorkerService::Info(grpc::ServerContext* ctx, const internal::v1::WorkerInfoRequest*,
                                 internal::v1::WorkerInfoReply* reply) {
  if (grpc::Status st = admission_.auth.Check(*ctx, "Worker.Info"); !st.ok()) return st;
  reply->set_rank(comm_->rank());
  reply->set_world_size(comm_->size());
  return grpc::Status::OK;
}

grpc::Status WorkerService::LoadLmHead(grpc::ServerContext* ctx, const internal::v1::LmHeadLoad* req,
                                       internal::v1::LoadLmHeadReply* reply) {
  if (grpc::Status st = admission_.auth.Check(*ctx, "Worker.LoadLmHead"); !st.ok()) return st;
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<int64_t> bytes = lm_heads_->Load(*req);
  if (!bytes.ok()) return ReplyWithReason(ctx, bytes.status());
  reply->set_bytes(*bytes);
  reply->set_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return grpc::Status::OK;
}

grpc::Status WorkerService::DropLmHead(grpc::ServerContext* ctx, const internal::v1::LmHeadRef* req,
                                       internal::v1::DropLmHeadReply* reply) {
  if (grpc::Status st = admission_.auth.Check(*ctx, "Worker.DropLmHead"); !st.ok()) return st;
  reply->set_dropped(lm_heads_->Drop(*req));
  return grpc::Status::OK;
}

grpc::Status WorkerService::StageLmHeadRows(grpc::ServerContext* ctx, const internal::v1::LmHeadStage* req,
                                            internal::v1::LmHeadStageReply* reply) {
  if (grpc::Status st = admission_.auth.Check(*ctx, "Worker.StageLmHeadRows"); !st.ok()) return st;
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<int64_t> bytes = logprob::StageLmHeadRows(*backend_, *req, admission_.lm_head_store_dir);
  if (!bytes.ok()) return ReplyWithReason(ctx, bytes.status());
  reply->set_bytes(*bytes);
  reply->set_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return grpc::Status::OK;
}

absl::StatusOr<int64_t> StageLmHeadRows(ScoringBackend& backend, const internal::v1::LmHeadStage& stage,
                                        const std::string& store_dir) {
  const internal::v1::CudaIpcPayload& src = stage.source();
  const std::string what = absl::StrCat("staging lm_head rows into ", stage.file());
  // Only the front-end's staged files, whatever the caller names.
  if (store_dir.empty())
    return absl::PermissionDeniedError(absl::StrCat(what, ": this worker was given no lm_head store folder"));
  const std::optional<std::string> name = StagedStoreFileName(stage.file(), store_dir);
  if (!name)
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": not a staged file (<name>.partial) directly in the front-end's lm_head store ", store_dir));
  if (stage.file_offset() < 0 || src.offset() < 0 || src.byte_size() < 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": file_offset ", stage.file_offset(), ", offset ",
                                                   src.offset(), " and byte_size ", src.byte_size(), " must be >= 0"));
  // A backend without a GPU says so before anything is opened.
  absl::StatusOr<std::unique_ptr<DeviceCopy>> copy = backend.NewDeviceCopy();
  if (!copy.ok())
    return CudaIpcRefused(absl::Status(copy.status().code(), absl::StrCat(what, ": ", copy.status().message())));
  // Opened beneath the store's descriptor, without following a link.
  const int dir = open(store_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return absl::NotFoundError(absl::StrCat(what, ": cannot open the store: ", std::strerror(errno)));
  // Non-blocking: a FIFO never blocks the open (no reader: ENXIO); a
  // regular file's writes ignore the flag.
  const int fd = openat(dir, name->c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY);
  const int open_errno = errno;
  close(dir);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(what, ": cannot open it: ", std::strerror(open_errno)));
  struct stat st {};
  absl::Status failed;
  if (fstat(fd, &st) != 0) {
    failed = absl::InternalError(absl::StrCat(what, ": fstat: ", std::strerror(errno)));
  } else if (!S_ISREG(st.st_mode)) {
    failed = absl::FailedPreconditionError(absl::StrCat(what, ": not a regular file"));
  } else if (stage.file_offset() > st.st_size || src.byte_size() > st.st_size - stage.file_offset()) {
    failed = absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", stage.file_offset(), ", ", stage.file_offset(),
                                                     " + ", src.byte_size(), ") are outside the file's ", st.st_size,
                                                     " bytes"));
  }
  if (failed.ok()) {
    absl::StatusOr<DevicePayload> device =
        backend.OpenCudaIpcPayload(src.handle(), src.offset(), src.byte_size(), src.allocation_bytes());
    if (!device.ok()) {
      failed = CudaIpcRefused(device.status());
    } else {
      std::vector<char> buffer;
      failed = CopyDeviceToFile(**copy, device->get(), static_cast<size_t>(src.byte_size()), fd,
                                static_cast<uint64_t>(stage.file_offset()), &buffer);
      if (!failed.ok()) failed = absl::Status(failed.code(), absl::StrCat(what, ": ", failed.message()));
    }
  }
  if (close(fd) != 0 && failed.ok())
    failed = absl::InternalError(absl::StrCat(what, ": close: ", std::strerror(errno)));
  if (!failed.ok()) return failed;
  return src.byte_size();
}

}  // namespace logprob
