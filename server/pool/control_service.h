// The front-end's control plane for workers: membership (the Join stream),
// rank assignment, the rendezvous key-value store for the worker
// communicator, readiness.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/internal_auth.h"
#include "common/version.h"
#include "common/worker_protocol.h"
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
/// RESOURCE_EXHAUSTED; a join whose protocol_version is not
/// `protocol_version` (a worker of another release) gets
/// FAILED_PRECONDITION naming both versions. StoreGet blocks until its keys
/// exist or its timeout passes (DEADLINE_EXCEEDED). Every method first
/// checks the caller (`auth`: UNAUTHENTICATED without the pool secret);
/// the store takes only the current generation's keys, within
/// kMaxStoreKeyBytes / kMaxStoreValueBytes / kMaxStoreBytes
/// (RESOURCE_EXHAUSTED beyond). Thread-safe.
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

  /// `protocol_version` is the version this front-end speaks (tests give
  /// another to play a front-end of another release).
  /// `auth`: who may call (the pool secret; Insecure only for an
  /// --insecure-internal-plane deployment or a unit test).
  ControlService(int world_size, internal::v1::JoinReply worker_config = {}, LeaveCallback on_leave = {},
                 JoinObservers observers = {}, uint32_t protocol_version = kWorkerProtocolVersion,
                 InternalAuth auth = InternalAuth::Insecure(), std::string build = BuildId());

  /// Limits of the rendezvous store (Gloo's addresses and NCCL's unique id
  /// are a few hundred bytes per rank).
  static constexpr size_t kMaxStoreKeyBytes = 512;
  static constexpr size_t kMaxStoreValueBytes = size_t{1} << 20;
  static constexpr size_t kMaxStoreBytes = size_t{16} << 20;
  static constexpr int kMaxStoreGetKeys = 4096;

  /// Completes every JoinReply just before it is sent (the lm_head
  /// versions to load), without the service's lock. Set before serving.
  void SetReplyHook(std::function<void(internal::v1::JoinReply*)> hook) { reply_hook_ = std::move(hook); }

  /// Which files ReadLmHeadRows may read (true: a file the front-end serves
  /// heads from). Set before serving; unset, ReadLmHeadRows refuses all.
  void SetLmHeadFiles(std::function<bool(const std::string& file)> servable) { lm_head_files_ = std::move(servable); }

  grpc::Status Join(grpc::ServerContext*, const internal::v1::JoinRequest*,
                    grpc::ServerWriter<internal::v1::JoinReply>*) override ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status Ready(grpc::ServerContext*, const internal::v1::ReadyRequest*, internal::v1::ReadyReply*) override
      ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status StoreSet(grpc::ServerContext*, const internal::v1::StoreSetRequest*,
                        internal::v1::StoreSetReply*) override ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status StoreGet(grpc::ServerContext*, const internal::v1::StoreGetRequest*,
                        internal::v1::StoreGetReply*) override ABSL_LOCKS_EXCLUDED(mu_);
  /// A worker's slice of an lm_head file, in pieces of at most 1 MiB
  /// (server/pool/control_lm_head_rows.cc), to members of the current
  /// generation only (req.generation; FAILED_PRECONDITION otherwise).
  /// PERMISSION_DENIED for a file (or bias file) SetLmHeadFiles does not
  /// allow; INVALID_ARGUMENT for a bad shape, a tensor that does not lie
  /// inside its file (checked before anything is allocated) or a row
  /// range outside [0, V]; ReadLmHeadRows' errors.
  /// Thread-safe; takes no lock.
  grpc::Status ReadLmHeadRows(grpc::ServerContext*, const internal::v1::LmHeadRowsRequest*,
                              grpc::ServerWriter<internal::v1::LmHeadRowsChunk>*) override;

  /// Waits until every rank reported Ready; returns their Worker service
  /// addresses by rank. DEADLINE_EXCEEDED names how many joined.
  absl::StatusOr<std::vector<std::string>> WaitAllReady(std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  /// True once the current generation's ranks are all given out.
  bool all_joined() ABSL_LOCKS_EXCLUDED(mu_);
  /// Number of workers that called Ready.
  int ready_count() ABSL_LOCKS_EXCLUDED(mu_);
  /// Starts pool generation `generation`: ends the previous members' Join
  /// streams, forgets ranks, addresses and the store. Workers still
  /// waiting for a rank keep their place.
  void Reset(int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  /// Ends every Join stream (UNAVAILABLE) and refuses new joins: the
  /// front-end is stopping. Call before shutting the gRPC server down.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  /// One Join call: a worker waiting for its rank, then a member. Lives
  /// on its Join call's stack; rank and generation are written under mu_
  /// (by AssignIfFull, from any thread) and read under mu_.
  struct Joiner {
    std::string who;  // "host (pid N, peer P)"
    int rank = -1;
    int64_t generation = -1;
  };
  /// Gives ranks to the waiting joiners once there are world_size of them.
  void AssignIfFull() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Queues `me` and waits until it has a rank of the current generation.
  /// Not OK when the join is refused, given up or overtaken by a Reset.
  grpc::Status WaitForRank(grpc::ServerContext* ctx, Joiner& me) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// True when the store holds every key of `req`.
  bool HasKeys(const internal::v1::StoreGetRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Reports waiting_.size() to the observer.
  void WaitingChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// OK when `generation` is the current one (ReadLmHeadRows).
  grpc::Status CheckMember(int64_t generation) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const int world_size_;
  const internal::v1::JoinReply worker_config_;
  const LeaveCallback on_leave_;
  std::function<void(internal::v1::JoinReply*)> reply_hook_;  // set before serving
  std::function<bool(const std::string&)> lm_head_files_;     // set before serving
  const JoinObservers observers_;
  const uint32_t protocol_version_;
  const std::string build_;  // BuildId(): a worker's JoinRequest.build must be it
  const InternalAuth auth_;

  absl::Mutex mu_;
  absl::CondVar cv_;  // signalled whenever a field below changes
  // Guarded by mu_.
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::string prefix_ ABSL_GUARDED_BY(mu_) = "gen0/";
  bool assigned_ ABSL_GUARDED_BY(mu_) = false;  // the generation's ranks are given out
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Joiner*> waiting_ ABSL_GUARDED_BY(mu_);  // in join order
  std::vector<std::string> addresses_ ABSL_GUARDED_BY(mu_);
  int ready_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::string> store_ ABSL_GUARDED_BY(mu_);
  size_t store_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // keys and values of store_
};

}  // namespace logprob
