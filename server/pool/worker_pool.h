// The front-end's pool of worker processes: spawns them, serves their
// control plane, runs planned work on them and supervises them.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "server/pool/control_service.h"
#include "server/pool/plan.h"
#include "server/pool/worker_launcher.h"

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
///
/// Thread-safe: Run may be called from any number of threads.
class WorkerPool {
 public:
  struct Options {
    int workers = 1;
    std::string control_listen = "127.0.0.1:0";
    /// Local launcher: from Start to all Ready. Waiting launcher: from the
    /// last join to all Ready (joining itself has no time limit).
    std::chrono::milliseconds join_timeout{60000};
    std::chrono::milliseconds work_timeout{600000};
    /// Sent to every worker in its JoinReply: hidden-states chunk, threads
    /// (rank, world size and store prefix are filled in).
    internal::v1::JoinReply worker_config;
    /// The lm_head versions a joining worker loads (JoinReply.lm_heads),
    /// asked at each join. May be empty.
    std::function<std::vector<internal::v1::LmHeadLoad>()> lm_heads;
    /// The files a worker may fetch lm_head rows of through the control
    /// plane (ControlService::SetLmHeadFiles). May be empty: none.
    std::function<bool(const std::string& file)> lm_head_files;
    /// Called with false when the pool fails and true when a generation is
    /// ready (health status). May be empty.
    std::function<void(bool serving)> on_serving;
    /// Called once per re-formed generation (metrics). May be empty.
    std::function<void()> on_restart;
    /// The control plane's membership observers (metrics: workers waiting
    /// for the pool to fill, refused joins). May be empty.
    ControlService::JoinObservers join_observers;
    /// Who may call the control plane, and what the pool's calls to the
    /// workers carry (the pool secret). Insecure only when the operator
    /// says so (--insecure-internal-plane) or in a unit test.
    InternalAuth auth = InternalAuth::Insecure();
  };

  WorkerPool(Options options, std::unique_ptr<WorkerLauncher> launcher);
  ~WorkerPool() ABSL_LOCKS_EXCLUDED(mu_);  // ends the Join streams and stops the workers

  /// Starts the control plane and supervising. With a launcher that does
  /// not wait for workers, first forms generation 0 and returns its error:
  /// UNAVAILABLE if a worker exits early, DEADLINE_EXCEEDED if they do not
  /// all become ready within join_timeout. With a waiting launcher, returns
  /// at once (not serving until the workers have joined).
  absl::Status Start() ABSL_LOCKS_EXCLUDED(mu_);
  /// host:port of the control plane (after Start).
  const std::string& control_address() const { return frontend_; }

  int size() const { return options_.workers; }
  /// True when the workers run on this host (WorkerLauncher::same_host).
  bool same_host() const { return launcher_->same_host(); }
  /// True while a generation is ready and has not failed.
  bool serving() const { return serving_; }
  /// Generations re-formed after a failure.
  int restarts() const { return restarts_; }
  /// Stops re-forming, for the server's drain after SIGTERM: from now on a
  /// generation that fails stays failed (its calls and later ones get
  /// UNAVAILABLE) and no worker is launched; the workers still running
  /// stop with the pool. Idempotent; thread-safe.
  void Drain() ABSL_LOCKS_EXCLUDED(mu_);

  /// Runs every item of `plan` on its worker concurrently and returns the
  /// results in plan order. Vocab-parallel and hidden-states plans run one
  /// at a time (their collectives must not interleave).
  /// Once `bounds` end (deadline passed, or bounds.cancelled() says so)
  /// the workers are told to stop the run (Worker.Stop; every rank of a
  /// collective plan stops at the same round) and Run returns, after every
  /// call has ended, DEADLINE_EXCEEDED / CANCELLED.
  /// UNAVAILABLE (worker named) when the pool is not serving or fails
  /// during the call; other worker errors come back with the worker named.
  absl::StatusOr<std::vector<internal::v1::WorkResult>> Run(const Plan& plan, const RunBounds& bounds = {})
      ABSL_LOCKS_EXCLUDED(mu_, collective_mu_);

  /// Loads an lm_head version on every worker of the current generation,
  /// concurrently, while items run; returns that generation's index (see
  /// Serving). UNAVAILABLE when the pool is not serving; otherwise the
  /// first worker's error, worker named. Does not fail the generation.
  absl::StatusOr<int64_t> LoadLmHead(const internal::v1::LmHeadLoad& load) ABSL_LOCKS_EXCLUDED(mu_);
  /// Drops an lm_head version on every worker of the current generation
  /// (best effort: a worker that is gone no longer holds it anyway). True
  /// when every worker answered.
  bool DropLmHead(const internal::v1::LmHeadRef& head) ABSL_LOCKS_EXCLUDED(mu_);
  /// True while generation `index` is the current one, ready and not failed.
  bool Serving(int64_t index) ABSL_LOCKS_EXCLUDED(mu_);
  /// Has one worker of the current generation (rank 0; every worker is on
  /// this host when same_host()) copy an update's rows from a CUDA IPC
  /// reference into the staged store file (Worker.StageLmHeadRows), while
  /// items run. UNAVAILABLE when the pool is not serving; otherwise the
  /// worker's error, worker named. Does not fail the generation.
  absl::Status StageLmHeadRows(const internal::v1::LmHeadStage& stage) ABSL_LOCKS_EXCLUDED(mu_);
  /// One piece of rank `rank`'s sums of a gradient step
  /// (Worker.ReadHeadGradients), while items run; and a step's close on
  /// every worker (Worker.CloseHeadGradientStep). UNAVAILABLE when the pool
  /// is not serving (a re-formed pool's workers lost their steps: they
  /// answer NOT_FOUND); otherwise the worker's error, worker named.
  absl::StatusOr<v1::HeadGradientsChunk> ReadHeadGradients(int rank,
                                                           const internal::v1::WorkerHeadGradientsRequest& req)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CloseHeadGradientStep(const std::string& step) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  /// One set of worker processes with their communicator.
  struct Generation {
    // Set by Form before `ready` is: constant once a Run can see them.
    int64_t index = 0;
    std::vector<std::unique_ptr<internal::v1::Worker::Stub>> stubs;

    absl::Mutex mu;
    bool ready ABSL_GUARDED_BY(mu) = false;  // every rank Ready, stubs made
    bool failed ABSL_GUARDED_BY(mu) = false;
    std::string failure ABSL_GUARDED_BY(mu);
    std::set<grpc::ClientContext*> inflight ABSL_GUARDED_BY(mu);  // Run's worker calls, cancelled by Fail
  };

  /// Makes generation `index` the current one and forms it: resets the
  /// control plane, launches, waits until every rank is Ready (watching for
  /// failures, time-out, stop and drain), connects to the workers, reports
  /// serving. CANCELLED without launching once draining. On error the
  /// caller stops the launcher.
  absl::Status Form(int64_t index) ABSL_LOCKS_EXCLUDED(mu_);
  /// Marks `gen` failed (once): not serving, cancels its calls in flight,
  /// wakes the supervisor to re-form the pool.
  void Fail(const std::shared_ptr<Generation>& gen, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_, gen->mu);
  /// The control plane's report of a member that left: fails its
  /// generation if it is the current one.
  void OnLeave(int64_t generation, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  /// Sets serving_ from the current generation's state and reports it
  /// through on_serving (serialised, so the last report is the truth).
  void Publish() ABSL_LOCKS_EXCLUDED(publish_mu_, mu_);
  void Supervise() ABSL_LOCKS_EXCLUDED(mu_);
  /// Runs `plan`'s items on the current generation (Run without the
  /// collective serialisation).
  absl::StatusOr<std::vector<internal::v1::WorkResult>> RunItems(const Plan& plan, const RunBounds& bounds)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Tells every worker of `plan` in `gen` to stop run `run_id`
  /// (Worker.Stop, concurrently; a worker that does not answer within 10 s
  /// is left to its Run call's failure).
  static void StopRun(Generation& gen, const Plan& plan, uint64_t run_id);
  std::shared_ptr<Generation> current() ABSL_LOCKS_EXCLUDED(mu_);
  /// Calls `call(stub, ctx)` on every worker of the current generation
  /// concurrently (each with a deadline of `timeout`); the generation's
  /// index, or UNAVAILABLE when not serving, or the first failed call's
  /// status with its rank named.
  absl::StatusOr<int64_t> OnEveryWorker(
      const std::function<grpc::Status(internal::v1::Worker::Stub&, grpc::ClientContext*)>& call,
      std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  /// OnEveryWorker on rank `rank` only.
  absl::StatusOr<int64_t> OnWorker(
      size_t rank, const std::function<grpc::Status(internal::v1::Worker::Stub&, grpc::ClientContext*)>& call,
      std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  /// Calls `call` on ranks [first, last) of the current generation
  /// (OnEveryWorker's semantics; last is clamped to the generation's size).
  absl::StatusOr<int64_t> OnWorkers(
      size_t first, size_t last,
      const std::function<grpc::Status(internal::v1::Worker::Stub&, grpc::ClientContext*)>& call,
      std::chrono::milliseconds timeout) ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping() ABSL_LOCKS_EXCLUDED(mu_);
  bool draining() ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;
  // Called from one thread at a time: Start, then the supervisor, then the
  // destructor (after joining the supervisor); same_host() from any.
  const std::unique_ptr<WorkerLauncher> launcher_;

  // Set by Start before the supervisor starts and Run may be called;
  // constant afterwards.
  std::string frontend_;  // control plane address given to workers
  std::unique_ptr<ControlService> control_;
  std::unique_ptr<grpc::Server> control_server_;
  std::thread supervisor_;

  absl::Mutex mu_;
  absl::CondVar cv_;  // signalled on stop_ and when a generation fails
  // Guarded by mu_.
  std::shared_ptr<Generation> gen_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // Drain(): no generation is formed any more

  /// Serialises Publish, so that the last on_serving report is the truth.
  absl::Mutex publish_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  /// Serialises the Runs of vocab-parallel and hidden-states plans: their
  /// workers run collectives (all-to-all, all-gather) on one communicator
  /// per generation, whose calls of two plans must not interleave. Guards
  /// no data; token-parallel plans (no collectives) do not take it.
  absl::Mutex collective_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  /// The next Run's id (kRunIdMetadataKey), from a random start so that
  /// workers outliving a front-end (cluster mode) never see an id again.
  std::atomic<uint64_t> next_run_id_{std::random_device{}() * (uint64_t{1} << 32)};
  std::atomic<bool> serving_{false};
  std::atomic<int> restarts_{0};
};

}  // namespace logprob
