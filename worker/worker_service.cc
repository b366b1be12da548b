#include "worker/worker_service.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/shared_memory.h"
#include "worker/scorer.h"
#include "worker/timed_communicator.h"

namespace logprob {

grpc::Status WorkerService::Run(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                                internal::v1::WorkResult* result) {
  const std::function<bool()> cancelled = [ctx] { return ctx->IsCancelled(); };
  // The payload: in the item, or in the front-end's shared memory.
  std::string_view payload = item->layout() == internal::v1::HIDDEN_STATES ? item->hidden_states() : item->logits();
  std::unique_ptr<SharedRegion> region;
  if (!item->payload_shm().empty()) {
    if (item->payload_offset() < 0 || item->payload_bytes() < 0)
      return ToGrpc(absl::InvalidArgumentError("work item: negative payload_offset or payload_bytes"));
    auto opened = SharedRegion::Open(item->payload_shm(), static_cast<size_t>(item->payload_offset()),
                                     static_cast<size_t>(item->payload_bytes()));
    if (!opened.ok())
      return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
          "work item payload in shared memory: ", opened.status().message(),
          " (is this worker on the front-end's host? start the server with --shared-memory=false otherwise)")));
    region = std::move(*opened);
    payload = std::string_view(region->data(), region->size());
  }
  absl::StatusOr<internal::v1::WorkResult> res;
  if (item->layout() != internal::v1::TOKEN_PARALLEL) {
    std::lock_guard<std::mutex> lock(collective_mu_);
    TimedCommunicator timed(*comm_);
    res = ScoreWorkItem(*item, payload, timed, *backend_, chunk_tokens_, cancelled);
    if (res.ok()) res->set_collective_seconds(timed.seconds());
  } else {
    SelfCommunicator self;
    res = ScoreWorkItem(*item, payload, self, *backend_, chunk_tokens_, cancelled);
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

}  // namespace logprob
