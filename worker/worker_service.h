// The worker's gRPC data plane (internal Worker service).
#pragma once

#include <memory>
#include <mutex>

#include "logprob/internal/v1/worker.grpc.pb.h"
#include "worker/communicator.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scorer.h"

namespace logprob {

/// Serves Run (score a WorkItem) and Info. Vocab-parallel and
/// hidden-states items use the communicator and run one at a time (the
/// front-end sends them in the same order to every rank); token-parallel
/// items run concurrently.
class WorkerService final : public internal::v1::Worker::Service {
 public:
  /// `lm_head` (may be null: no hidden-states scoring) is this rank's
  /// vocabulary slice; `chunk_tokens` as HiddenScoring::chunk_tokens.
  WorkerService(std::unique_ptr<Communicator> comm, std::unique_ptr<kernels::LmHeadGemm> lm_head = nullptr,
                int64_t chunk_tokens = 128)
      : comm_(std::move(comm)), lm_head_(std::move(lm_head)), hidden_{lm_head_.get(), chunk_tokens} {}
  grpc::Status Run(grpc::ServerContext* ctx, const internal::v1::WorkItem* item,
                   internal::v1::WorkResult* result) override;
  grpc::Status Info(grpc::ServerContext* ctx, const internal::v1::WorkerInfoRequest* req,
                    internal::v1::WorkerInfoReply* reply) override;

 private:
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<kernels::LmHeadGemm> lm_head_;
  HiddenScoring hidden_;
  std::mutex collective_mu_;
};

}  // namespace logprob
