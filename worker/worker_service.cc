#include "worker/worker_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "worker/scorer.h"
#include "worker/timed_communicator.h"

namespace logprob {
namespace {

/// OK when every rank's `mine` is OK (one 1-byte all-gather); else this
/// rank's error, or FAILED_PRECONDITION naming the first rank that failed.
/// Ranks that mapped a CUDA IPC input agree on it before the item's
/// collectives, so one rank failing does not leave the others waiting.
absl::Status AllRanksOk(Communicator& comm, const absl::Status& mine) {
  const absl::StatusOr<int> failed = FirstRankFlagged(comm, !mine.ok());
  if (!failed.ok()) return failed.status();
  if (!mine.ok()) return mine;
  if (*failed >= 0)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC input: worker rank ", *failed, " could not map its rows (its log says why)"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ItemPayload> WorkerService::OpenPayload(const internal::v1::WorkItem& item,
                                                       std::shared_ptr<SharedRegion>* region, DevicePayload* device) {
  if (item.has_cuda_ipc()) {
    const internal::v1::CudaIpcPayload& ipc = item.cuda_ipc();
    auto opened = backend_->OpenCudaIpcPayload(ipc.handle(), ipc.offset(), ipc.byte_size());
    if (!opened.ok()) return opened.status();
    *device = *std::move(opened);
    return ItemPayload(std::string_view(device->get(), static_cast<size_t>(ipc.byte_size())), /*device=*/true);
  }
  auto found = payload_regions_.Payload(item, region);
  if (!found.ok()) return found.status();
  return ItemPayload(*found);
}

grpc::Status WorkerService::Run(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                                internal::v1::WorkResult* result) {
  const std::function<bool()> cancelled = [ctx] { return ctx->IsCancelled(); };
  // The payload: in the item, in the front-end's shared memory, or (a CUDA
  // IPC input) in a same-host client's GPU allocation, mapped while the
  // item runs.
  std::shared_ptr<SharedRegion> region;
  DevicePayload device;
  const absl::StatusOr<ItemPayload> payload = OpenPayload(*item, &region, &device);
  const bool ipc = item->has_cuda_ipc();
  // Hidden states: the lm_head version the item names, alive until it ends.
  std::shared_ptr<const LmHeadWeights> lm_head;
  if (item->layout() == internal::v1::HIDDEN_STATES) {
    lm_head = lm_heads_->Find(item->lm_head());
    if (!lm_head) return ToGrpc(NoLmHeadError(item->lm_head().name(), item->lm_head().version()));
  }
  absl::StatusOr<internal::v1::WorkResult> res;
  if (item->layout() != internal::v1::TOKEN_PARALLEL) {
    absl::MutexLock lock(&collective_mu_);
    TimedCommunicator timed(*comm_);
    if (ipc) {
      if (absl::Status st = AllRanksOk(timed, payload.status()); !st.ok()) return ToGrpc(st);
    } else if (!payload.ok()) {
      return ToGrpc(payload.status());
    }
    res = ScoreWorkItem(*item, *payload, timed, *backend_, chunk_tokens_, cancelled, lm_head.get());
    if (res.ok()) res->set_collective_seconds(timed.seconds());
  } else {
    if (!payload.ok()) return ToGrpc(payload.status());
    SelfCommunicator self;
    res = ScoreWorkItem(*item, *payload, self, *backend_, chunk_tokens_, cancelled, lm_head.get());
  }
  if (!res.ok()) return ToGrpc(res.status());
  res->set_device_memory_bytes(backend_->device_memory_bytes());
  *result = std::move(*res);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Info(grpc::ServerContext*, const internal::v1::WorkerInfoRequest*,
                                 internal::v1::WorkerInfoReply* reply) {
  reply->set_rank(comm_->rank());
  reply->set_world_size(comm_->size());
  return grpc::Status::OK;
}

grpc::Status WorkerService::LoadLmHead(grpc::ServerContext*, const internal::v1::LmHeadLoad* req,
                                       internal::v1::LoadLmHeadReply* reply) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<int64_t> bytes = lm_heads_->Load(*req);
  if (!bytes.ok()) return ToGrpc(bytes.status());
  reply->set_bytes(*bytes);
  reply->set_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return grpc::Status::OK;
}

grpc::Status WorkerService::DropLmHead(grpc::ServerContext*, const internal::v1::LmHeadRef* req,
                                       internal::v1::DropLmHeadReply* reply) {
  reply->set_dropped(lm_heads_->Drop(*req));
  return grpc::Status::OK;
}

}  // namespace logprob
