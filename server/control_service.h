// The front-end's control plane for workers: rank assignment, the
// rendezvous key-value store for the worker communicator, readiness.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.grpc.pb.h"

namespace logprob {

/// Control service for one pool generation of `world_size` workers.
/// Ranks are given in Join order; every JoinReply starts from
/// `worker_config` (lm_head source, chunk size, threads). StoreGet blocks
/// until its keys exist or its timeout passes (DEADLINE_EXCEEDED).
class ControlService final : public internal::v1::Control::Service {
 public:
  ControlService(int world_size, std::string store_prefix, internal::v1::JoinReply worker_config = {});

  grpc::Status Join(grpc::ServerContext*, const internal::v1::JoinRequest*, internal::v1::JoinReply*) override;
  grpc::Status Ready(grpc::ServerContext*, const internal::v1::ReadyRequest*, internal::v1::ReadyReply*) override;
  grpc::Status StoreSet(grpc::ServerContext*, const internal::v1::StoreSetRequest*, internal::v1::StoreSetReply*) override;
  grpc::Status StoreGet(grpc::ServerContext*, const internal::v1::StoreGetRequest*, internal::v1::StoreGetReply*) override;

  /// Waits until every rank reported Ready; returns their Worker service
  /// addresses by rank. DEADLINE_EXCEEDED names how many joined.
  absl::StatusOr<std::vector<std::string>> WaitAllReady(std::chrono::milliseconds timeout);
  /// Number of workers that called Ready.
  int ready_count();
  /// Starts a new pool generation: forgets ranks, addresses and the store,
  /// and uses `store_prefix` for the new communicator. Call after the
  /// previous generation's workers are gone.
  void Reset(std::string store_prefix);

 private:
  const int world_size_;
  std::string prefix_;
  const internal::v1::JoinReply worker_config_;
  std::mutex mu_;
  std::condition_variable cv_;
  int next_rank_ = 0;
  std::vector<std::string> addresses_;
  int ready_ = 0;
  std::map<std::string, std::string> store_;
};

}  // namespace logprob
