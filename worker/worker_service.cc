#include "worker/worker_service.h"

#include "common/grpc_status.h"
#include "worker/scorer.h"
#include "worker/timed_communicator.h"

namespace logprob {

grpc::Status WorkerService::Run(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                                internal::v1::WorkResult* result) {
  const std::function<bool()> cancelled = [ctx] { return ctx->IsCancelled(); };
  // The payload: in the item, or in the front-end's shared memory.
  std::shared_ptr<SharedRegion> region;
  auto found = payload_regions_.Payload(*item, &region);
  if (!found.ok()) return ToGrpc(found.status());
  const std::string_view payload = *found;
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
