// The front-end's control plane for workers: membership (the Join stream),
// rank assignment, the rendezvous key-value store for the worker
// communicator, readiness.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.grpc.pb.h"

namespace logprob {

/// Control service for a pool of `world_size` workers, one generation at a
/// time (generation g uses the store prefix "gen<g>/").
///
/// Join is a stream held for as long as the worker belongs to the pool.
/// Joiners wait until `world_size` of them are there; then ranks are given
/// in join order and each gets its JoinReply (starting from
/// `worker_config`: lm_head source, chunk size, threads). A joiner that
/// goes away while waiting just gives up its place. A member whose stream
/// breaks (process gone, network lost) is reported through `on_leave`;
/// Reset ends the members' streams with UNAVAILABLE so they join again.
/// A join while the generation has its `world_size` workers gets
/// RESOURCE_EXHAUSTED. StoreGet blocks until its keys exist or its timeout
/// passes (DEADLINE_EXCEEDED).
class ControlService final : public internal::v1::Control::Service {
 public:
  /// Called (from a gRPC thread, without locks held) when a worker holding
  /// `rank` of `generation` leaves; `why` describes it.
  using LeaveCallback = std::function<void(int64_t generation, int rank, const std::string& why)>;

  /// Observers of membership (metrics; each may be empty), called with the
  /// service's lock held, so they must not call back into it.
  struct JoinObservers {
    /// The number of workers waiting for a rank, whenever it changes.
    std::function<void(int waiting)> on_waiting;
    /// A join refused with RESOURCE_EXHAUSTED (the pool already has its workers).
    std::function<void()> on_refused;
  };

  ControlService(int world_size, internal::v1::JoinReply worker_config = {}, LeaveCallback on_leave = {},
                 JoinObservers observers = {});

  grpc::Status Join(grpc::ServerContext*, const internal::v1::JoinRequest*,
                    grpc::ServerWriter<internal::v1::JoinReply>*) override;
  grpc::Status Ready(grpc::ServerContext*, const internal::v1::ReadyRequest*, internal::v1::ReadyReply*) override;
  grpc::Status StoreSet(grpc::ServerContext*, const internal::v1::StoreSetRequest*, internal::v1::StoreSetReply*) override;
  grpc::Status StoreGet(grpc::ServerContext*, const internal::v1::StoreGetRequest*, internal::v1::StoreGetReply*) override;

  /// Waits until every rank reported Ready; returns their Worker service
  /// addresses by rank. DEADLINE_EXCEEDED names how many joined.
  absl::StatusOr<std::vector<std::string>> WaitAllReady(std::chrono::milliseconds timeout);
  /// True once the current generation's ranks are all given out.
  bool all_joined();
  /// Number of workers that called Ready.
  int ready_count();
  /// Starts pool generation `generation`: ends the previous members' Join
  /// streams, forgets ranks, addresses and the store. Workers still
  /// waiting for a rank keep their place.
  void Reset(int64_t generation);
  /// Ends every Join stream (UNAVAILABLE) and refuses new joins: the
  /// front-end is stopping. Call before shutting the gRPC server down.
  void Shutdown();

 private:
  /// One Join call: a worker waiting for its rank, then a member.
  struct Joiner {
    std::string who;  // "host (pid N, peer P)"
    int rank = -1;
    int64_t generation = -1;
  };
  /// Gives ranks to the waiting joiners once there are world_size of them.
  void AssignIfFull();
  /// Reports waiting_.size() to the observer (lock held).
  void WaitingChanged();

  const int world_size_;
  const internal::v1::JoinReply worker_config_;
  const LeaveCallback on_leave_;
  const JoinObservers observers_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t generation_ = 0;
  std::string prefix_ = "gen0/";
  bool assigned_ = false;  // the generation's ranks are given out
  bool shutdown_ = false;
  std::vector<Joiner*> waiting_;  // in join order
  std::vector<std::string> addresses_;
  int ready_ = 0;
  std::map<std::string, std::string> store_;
};

}  // namespace logprob
