// The front-end's pool of worker processes: spawns them, serves their
// control plane, runs planned work on them and supervises them.
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

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

namespace logprob {

/// What bounds one WorkerPool::Run: a deadline and a cancellation test
/// (polled every 20 ms; may be empty).
struct RunBounds {
  std::chrono::system_clock::time_point deadline = std::chrono::system_clock::time_point::max();
  std::function<bool()> cancelled;
  bool expired() const { return std::chrono::system_clock::now() >= deadline; }
};

/// A local pool of `workers` logprob-worker processes on this host.
///
/// Supervision: a monitor thread notices a worker process that exits, and
/// Run notices a worker that fails or hangs (a collective error or time-out
/// comes back as UNAVAILABLE / DEADLINE_EXCEEDED). Either way the pool
/// fails every call in flight with UNAVAILABLE, reports not serving, kills
/// the remaining workers, spawns a new generation (new ranks, new
/// communicator) and reports serving again.
class WorkerPool {
 public:
  struct Options {
    int workers = 1;
    std::string worker_binary;                 // path of logprob-worker
    std::string control_listen = "127.0.0.1:0";
    std::vector<std::string> worker_args;      // extra flags for each worker
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
  };

  explicit WorkerPool(Options options);
  ~WorkerPool();  // terminates the workers

  /// Starts the control plane, spawns the workers and waits until all are
  /// ready, then starts supervising. UNAVAILABLE if a worker exits early,
  /// DEADLINE_EXCEEDED if they do not all join within join_timeout.
  absl::Status Start();

  int size() const { return options_.workers; }
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
    int index = 0;
    std::vector<pid_t> pids;
    std::vector<std::unique_ptr<internal::v1::Worker::Stub>> stubs;
    std::mutex mu;                          // guards failed, inflight
    bool failed = false;
    std::string failure;
    std::set<grpc::ClientContext*> inflight;
  };

  absl::Status Spawn(Generation& gen);
  /// Marks `gen` failed (once): not serving, cancels its calls in flight,
  /// wakes the supervisor to re-form the pool.
  void Fail(const std::shared_ptr<Generation>& gen, const std::string& why);
  void Supervise();
  static void Kill(Generation& gen);
  std::shared_ptr<Generation> current();

  Options options_;
  std::string frontend_;  // control plane address given to workers
  std::unique_ptr<ControlService> control_;
  std::unique_ptr<grpc::Server> control_server_;
  std::mutex mu_;  // guards gen_, stop_
  std::condition_variable cv_;
  std::shared_ptr<Generation> gen_;
  bool stop_ = false;
  std::atomic<bool> serving_{false};
  std::atomic<int> restarts_{0};
  std::thread supervisor_;
  std::mutex collective_mu_;
};

}  // namespace logprob
