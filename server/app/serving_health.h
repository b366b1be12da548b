// logprob-server's life after start: the grpc.health.v1 status it
// publishes (SERVING while the pool is up and the heads are caught up with
// the peers), the wait for SIGTERM / SIGINT and the drain.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <mutex>

#include "absl/status/status.h"
#include "server/pool/worker_pool.h"

namespace logprob {

/// The public server's health: SERVING while the worker pool is up and
/// the lm_heads have caught up with the peers, NOT_SERVING otherwise and
/// once a stop signal came. Thread-safe.
class ServingHealth {
 public:
  /// `heads_synced`: no peer sync to wait for (no --lm-head-sync-from).
  explicit ServingHealth(bool heads_synced) : heads_synced_(heads_synced) {}

  /// The server to publish to, once it is started (not owned; none before).
  void SetServer(grpc::Server* server);
  /// The pool went up or down (WorkerPool::Options::on_serving); publishes.
  void SetPoolUp(bool up);
  /// The heads caught up with the peers; publishes.
  void SetHeadsSynced();
  /// ServiceConfig::lm_heads_ready: UNAVAILABLE while catching up with the
  /// peers (a replica serves no hidden-states request until then).
  std::function<absl::Status()> HeadsReady();

 private:
  void Publish();

  std::atomic<grpc::Server*> server_{nullptr};
  std::atomic<bool> heads_synced_;
  std::mutex mu_;
  bool pool_up_ = false;  // guarded by mu_
};

/// From now on SIGTERM and SIGINT ask the server to stop (StopRequested).
void InstallStopSignals();

/// True once SIGTERM or SIGINT came (after InstallStopSignals).
bool StopRequested();

/// Returns once a stop signal came; meanwhile, once a second, gives freed
/// memory over --keep-freed-memory-bytes back to the OS (the trims around
/// large requests miss what is freed after the last one).
void WaitForStopSignal();

/// The drain after a stop signal: logs, stops the pool from re-forming,
/// publishes NOT_SERVING, then refuses new calls and gives the ones in
/// flight `grace_seconds` before cancelling them.
void Drain(WorkerPool& pool, grpc::Server& server, int grace_seconds);

}  // namespace logprob
