// Dynamic batching: requests that need the same per-row work queue for a
// few milliseconds and run on the worker pool as one plan.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "logprob/internal/v1/worker.pb.h"
#include "server/core/planner.h"
#include "server/core/score_job.h"
#include "server/pool/worker_pool.h"

namespace logprob {

/// Packs queued ScoreJobs into worker batches by a token budget, without
/// padding (their rows are concatenated). A batch starts at once when no
/// other batch is running (an idle pool adds no latency); while one is, the
/// oldest job waits for company until the running batches end, its key's
/// queued rows fill the budget, or max_queue_delay has passed since it
/// arrived.
///
/// Only jobs with the same batch key are packed together: same input kind
/// (logits or hidden states), dtype, V, H, gather_k, normalised options and
/// the layout the job would get alone. A job that is not batchable
/// (ScoreJob::batchable: a CUDA IPC input) has a key of its own: it always
/// runs alone. Results are therefore bitwise those
/// of scoring each job alone: every row is scored whole by one worker, or
/// over the same vocab slices SplitRange(V, W, r) whose partials are
/// combined in rank order whoever owns the row (worker/scoring/scorer.h); the
/// hidden-states GEMM gives each row the same values whatever the other
/// rows of its chunk (oneDNN's row results do not depend on M; the batching
/// test checks it through the server).
///
/// Leader/follower, no thread of its own: the oldest queued job of a key
/// forms the batch and runs it on its request's thread; the others wait
/// for their rows. Thread-safe.
///
/// Lifetimes: every entry of a batch owns its job (shared_ptr), so the
/// leader never reads a job that its caller has dropped. The input bytes a
/// job's rows point into belong to the caller (a gRPC request, pooled
/// ScoreChunked buffers); the leader reads them only while it plans the
/// batch (PlanWork copies them into the work items), so a job that leaves
/// a running batch waits until the batch is planned, never for its
/// workers, and its caller may free the bytes as soon as Run returns. A
/// job's RunBounds are consulted only while its Run call is in progress.
class Batcher {
 public:
  /// How one job's batch went.
  struct Outcome {
    std::shared_ptr<const Plan> plan;                                      // the batch's plan
    std::shared_ptr<const std::vector<internal::v1::WorkResult>> results;  // one per plan item
    int64_t row_begin = 0;                                                 // the job's first row among the plan's rows
    double queue_seconds = 0;                                              // queued until its batch started
    double run_seconds = 0;                                                // the batch's Runner call
    int batch_requests = 1;                                                // jobs in the batch
    int64_t batch_tokens = 0;                                              // token rows in the batch
  };

  struct Options {
    /// Longest a batch's oldest job waits for company while other batches
    /// run; 0 packs only what is already queued.
    std::chrono::microseconds max_queue_delay{2000};
    /// Token rows per batch; a job over it alone runs alone.
    int64_t max_batch_tokens = 8192;
    int workers = 1;
    Parallelism parallelism = Parallelism::kAuto;
    /// Payloads through shared memory (PlanWork) when set: workers on this
    /// host. Not owned; outlives the batcher.
    PayloadPool* payload_pool = nullptr;
    /// Called with the number of queued jobs whenever it changes, under
    /// the lock (metrics gauge). May be empty.
    std::function<void(int64_t queued)> on_queue_change;
    /// Called with the number of batches inside their Runner call (the
    /// worker pool is busy with them) whenever it changes, under the lock
    /// (metrics gauge). May be empty.
    std::function<void(int64_t running)> on_running_change;
    /// Called once per successful batch with its first job's outcome and
    /// the workers' results (metrics). May be empty.
    std::function<void(const Outcome&, const std::vector<internal::v1::WorkResult>&)> on_batch;
  };

  /// Runs a batch's plan (WorkerPool::Run in the service).
  using Runner = std::function<absl::StatusOr<std::vector<internal::v1::WorkResult>>(const Plan&, const RunBounds&)>;

  Batcher(Options options, Runner run);

  /// Queues `job` and returns once its batch has run: the batch's error, or
  /// its Outcome (BuildResponse with outcome.row_begin gives the job's
  /// response). The bytes its rows point into must stay valid until Run
  /// returns, and no longer (see Lifetimes above). As soon as `bounds` say
  /// so, DEADLINE_EXCEEDED or CANCELLED: a queued job leaves the queue; a
  /// job whose batch is running is abandoned once the batch is planned (the
  /// others still get their rows; the batch's worker calls stop when every
  /// job has gone).
  absl::StatusOr<Outcome> Run(std::shared_ptr<const ScoreJob> job, uint64_t job_id, const RunBounds& bounds)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry;
  using Queue = std::list<std::shared_ptr<Entry>>;

  /// The batch key of `job`, whose layout alone is `layout`.
  static std::string KeyOf(const ScoreJob& job, internal::v1::Layout layout);
  /// Waits until `e`'s batch should start: budget full, delay over, or e's
  /// bounds end (false: e left the queue).
  bool WaitToLead(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Reports the queue length.
  void QueueChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Takes e's batch out of the queue, oldest first.
  std::vector<std::shared_ptr<Entry>> TakeBatch(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Run's loop for queued entry `e`: leads its batch or waits for it, and
  /// returns its outcome or the error saying where it left.
  absl::StatusOr<Outcome> Wait(const std::shared_ptr<Entry>& e, uint64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Runs `batch` and hands every entry its outcome.
  void RunBatch(const std::vector<std::shared_ptr<Entry>>& batch, uint64_t job_id) ABSL_LOCKS_EXCLUDED(mu_);
  /// True when no job of `batch` still wants its rows: each has left or
  /// its bounds ended. Reads only the bounds of jobs still inside Run.
  bool AllEnded(const std::vector<std::shared_ptr<Entry>>& batch) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;
  const Runner run_;

  absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when the queue or running_ changes
  // Guarded by mu_ (so are the state, status and outcome of every Entry).
  Queue queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // batches between TakeBatch and the end of RunBatch
  int calling_ ABSL_GUARDED_BY(mu_) = 0;  // batches inside their Runner call
};

/// The job of a batch: `jobs`' rows concatenated in order (rows, targets,
/// gather ids, segments; out_pos and out_shape are left empty). All must share a
/// batch key.
ScoreJob ConcatJobs(const std::vector<const ScoreJob*>& jobs);

}  // namespace logprob
