// The front-end's pool of worker processes: spawns them, serves their
// control plane, runs planned work on them and supervises them.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "server/control_service.h"
#include "server/planner.h"
#include "server/worker_launcher.h"

namespace logprob {

/// What bounds one WorkerPool::Run: a deadline and a cancellation test
/// (polled every 20 ms; may be empty).
struct RunBounds {
  std::chrono::system_clock::time_point deadline = std::chrono::system_clock::time_point::max();
  std::function<bool()> cancelled;
  bool expired() const { return std::chrono::system_clock::now() >= deadline; }
  /// True when `cancelled` is set and says so.
  bool cancelled_now() const { return cancelled && cancelled(); }
  /// Expired or cancelled: nobody wants the answer any more.
  bool ended() const { return expired() || cancelled_now(); }
};

/// A pool of `workers` logprob-worker processes, run in generations.
/// The WorkerLauncher decides where the processes come from (spawned here,
/// or started elsewhere and joining by themselves: cluster mode); the
/// generations, ranks and supervision are the same either way.
///
/// Supervision: a worker is seen gone when its process exits (launcher
/// Poll), when its Join stream to the control plane ends, or when a Worker
/// call fails or hangs (a collective error or time-out comes back as
/// UNAVAILABLE / DEADLINE_EXCEEDED). The pool then fails every call in
/// flight with UNAVAILABLE, reports not serving, stops the generation
/// (launcher Stop), resets the control plane, which ends the surviving
/// workers' Join streams, and forms a new generation (new ranks, new
/// communicator), reporting serving once it is ready.
class WorkerPool {
 public:
  struct Options {
    int workers = 1;
    std::string control_listen = "127.0.0.1:0";
    /// Local launcher: from Start to all Ready. Waiting launcher: from the
    /// last join to all Ready (joining itself has no time limit).
    std::chrono::milliseconds join_timeout{60000};
    std::chrono::milliseconds work_timeout{600000};
    /// Sent to every worker in its JoinReply: lm_head source, hidden-states
    /// chunk, threads (rank, world size and store prefix are filled in).
    internal::v1::JoinReply worker_config;
    /// Called with false when the pool fails and true when a generation is
    /// ready (health status). May be empty.
    std::function<void(bool serving)> on_serving;
    /// Called once per re-formed generation (metrics). May be empty.
    std::function<void()> on_restart;
    /// The control plane's membership observers (metrics: workers waiting
    /// for the pool to fill, refused joins). May be empty.
    ControlService::JoinObservers join_observers;
  };

  WorkerPool(Options options, std::unique_ptr<WorkerLauncher> launcher);
  ~WorkerPool();  // ends the Join streams and stops the workers

  /// Starts the control plane and supervising. With a launcher that does
  /// not wait for workers, first forms generation 0 and returns its error:
  /// UNAVAILABLE if a worker exits early, DEADLINE_EXCEEDED if they do not
  /// all become ready within join_timeout. With a waiting launcher, returns
  /// at once (not serving until the workers have joined).
  absl::Status Start();
  /// host:port of the control plane (after Start).
  const std::string& control_address() const { return frontend_; }

  int size() const { return options_.workers; }
  /// True when the workers run on this host (WorkerLauncher::same_host).
  bool same_host() const { return launcher_->same_host(); }
  /// True while a generation is ready and has not failed.
  bool serving() const { return serving_; }
  /// Generations re-formed after a failure.
  int restarts() const { return restarts_; }

  /// Runs every item of `plan` on its worker concurrently and returns the
  /// results in plan order. Vocab-parallel and hidden-states plans run one
  /// at a time (their collectives must not interleave).
  /// `bounds` limit the worker calls by a deadline and cancel them when
  /// bounds.cancelled() says so: DEADLINE_EXCEEDED / CANCELLED.
  /// UNAVAILABLE (worker named) when the pool is not serving or fails
  /// during the call; other worker errors come back with the worker named.
  absl::StatusOr<std::vector<internal::v1::WorkResult>> Run(const Plan& plan,
                                                            const RunBounds& bounds = {});

 private:
  /// One set of worker processes with their communicator.
  struct Generation {
    int64_t index = 0;
    std::vector<std::unique_ptr<internal::v1::Worker::Stub>> stubs;
    std::mutex mu;                          // guards ready, failed, inflight
    bool ready = false;                     // every rank Ready, stubs made
    bool failed = false;
    std::string failure;
    std::set<grpc::ClientContext*> inflight;
  };

  /// Makes generation `index` the current one and forms it: resets the
  /// control plane, launches, waits until every rank is Ready (watching for
  /// failures, time-out and stop), connects to the workers, reports
  /// serving. On error the caller stops the launcher.
  absl::Status Form(int64_t index);
  /// Marks `gen` failed (once): not serving, cancels its calls in flight,
  /// wakes the supervisor to re-form the pool.
  void Fail(const std::shared_ptr<Generation>& gen, const std::string& why);
  /// The control plane's report of a member that left: fails its
  /// generation if it is the current one.
  void OnLeave(int64_t generation, const std::string& why);
  /// Sets serving_ from the current generation's state and reports it
  /// through on_serving (serialised, so the last report is the truth).
  void Publish();
  void Supervise();
  std::shared_ptr<Generation> current();
  bool stopping();

  Options options_;
  std::unique_ptr<WorkerLauncher> launcher_;
  std::string frontend_;  // control plane address given to workers
  std::unique_ptr<ControlService> control_;
  std::unique_ptr<grpc::Server> control_server_;
  std::mutex mu_;  // guards gen_, stop_
  std::condition_variable cv_;
  std::shared_ptr<Generation> gen_;
  bool stop_ = false;
  std::mutex publish_mu_;
  std::atomic<bool> serving_{false};
  std::atomic<int> restarts_{0};
  std::thread supervisor_;
  std::mutex collective_mu_;
};

}  // namespace logprob
