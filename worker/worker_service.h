// The worker's gRPC data plane (internal Worker service).
#pragma once

#include <memory>
#include <mutex>

#include "logprob/internal/v1/worker.grpc.pb.h"
#include "worker/communicator.h"

namespace logprob {

/// Serves Run (score a WorkItem) and Info. Vocab-parallel items use the
/// communicator and run one at a time (the front-end sends them in the
/// same order to every rank); token-parallel items run concurrently.
class WorkerService final : public internal::v1::Worker::Service {
 public:
  explicit WorkerService(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  grpc::Status Run(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                   internal::v1::WorkResult* result) override;
  grpc::Status Info(grpc::ServerContext* ctx, const internal::v1::WorkerInfoRequest* req,
                    internal::v1::WorkerInfoReply* reply) override;

 private:
  std::unique_ptr<Communicator> comm_;
  std::mutex collective_mu_;
};

}  // namespace logprob
