// The scoring core: requests, their byte sources, admission, batching and
// the workers, with no transport types (the gRPC adapter is
// server/transport/scoring_service.h), so it runs and is tested without a server.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"
#include "server/core/admission.h"
#include "server/core/batcher.h"
#include "server/core/distill_job.h"
#include "server/core/head_gradients.h"
#include "server/core/planner.h"
#include "server/core/rollout_mismatch.h"
#include "server/core/score_job.h"
#include "server/heads/lm_heads.h"
#include "server/inputs/input_resolver.h"
#include "server/pool/payload_pool.h"

namespace logprob {

/// Serving configuration reported by GetServerInfo.
struct ServiceConfig {
  RequestLimits limits;
  /// Largest request, bytes: one message (Score, ScoreStream) or the sum
  /// of a chunked request's parts (ScoreChunked).
  int64_t max_request_bytes = int64_t{1} << 30;
  int64_t max_queue_tokens = int64_t{1} << 23;      // admitted, unanswered tokens (backpressure)
  int64_t max_queue_bytes = int64_t{2} << 30;       // admitted, unanswered request bytes
  std::chrono::microseconds max_queue_delay{2000};  // dynamic batching (Batcher::Options)
  int64_t max_batch_tokens = 8192;
  bool shared_memory = true;  // payloads to same-host workers through POSIX shared memory
  Parallelism parallelism = Parallelism::kAuto;
  std::string parallelism_name = "auto";
  std::string backend = "cpu";
  std::string comm = "gloo";
  /// The named lm_heads for hidden-states requests (not owned; outlives
  /// the core); null or empty: no hidden-states scoring.
  const LmHeads* lm_heads = nullptr;
  /// The GEMM operands' name for weights of a dtype ("bf16", "tf32",
  /// "fp32": --lm-head-precision resolved); may be empty.
  std::function<std::string(DType)> lm_head_precision;
  /// The CPU pool's bf16 GEMM kernel ("bf16", "widen"; "" for cuda):
  /// ServerInfo.lm_head_cpu_kernel.
  std::string lm_head_cpu_kernel;
  /// lm_head updates are accepted (ServerInfo.lm_head_updates).
  bool lm_head_updates = false;
  /// When set and not OK, hidden-states requests fail with its status (a
  /// replica catching up with its peers: UNAVAILABLE until it holds their
  /// newest versions; server/transport/lm_head_peer_sync.h). Thread-safe.
  std::function<absl::Status()> lm_heads_ready;
  /// The lm_head store's bytes (ServerInfo.lm_head_store_bytes,
  /// LmHeadStore::Bytes); empty: 0.
  std::function<int64_t()> lm_head_store_bytes;
  int64_t hidden_chunk_tokens = 0;
  // Shared-memory and CUDA IPC inputs: the InputResolver's options
  // (server/inputs/input_resolver.h).
};

/// What a call brings besides its request, whatever its transport.
struct CallContext {
  /// The work stops (DEADLINE_EXCEEDED) at this time.
  std::chrono::system_clock::time_point deadline = std::chrono::system_clock::time_point::max();
  /// True once the caller has gone (CANCELLED). May be empty. Called only
  /// while the Score call that got it is in progress.
  std::function<bool()> cancelled;
  /// The caller's shared-memory session and address, for references
  /// (InputResolver).
  InputCaller caller;
  /// The request's bytes as they arrived, reserved before its body was read
  /// (the unary Score's announced or largest size, ScoreChunked's announced
  /// total; null: none). The core admits the request into this ticket, so
  /// its bytes count once, from before they arrive until it is answered.
  Admission::Ticket* received = nullptr;
};

/// What one request's log line reports besides its status.
struct RequestStats {
  int64_t rows = 0;            // token positions scored
  double queue_seconds = 0;    // waiting to be batched
  int batch_requests = 0;      // requests in its worker batch
  double receive_seconds = 0;  // ScoreChunked: first part to the last piece
};

/// What the core reports as it works (metrics gauges and histograms,
/// wired by the transport: server/transport/scoring_service.cc). Each may
/// be empty; called from the core's threads, so they must be thread-safe.
struct CoreObservers {
  /// Admitted, unanswered work changed.
  std::function<void(int64_t requests, int64_t tokens, int64_t bytes)> on_load;
  /// Requests queued for batching, and batches running (Batcher::Options).
  std::function<void(int64_t queued)> on_queued;
  std::function<void(int64_t running)> on_running;
  /// A batch ran (Batcher::Options::on_batch).
  std::function<void(const Batcher::Outcome& batch, const std::vector<internal::v1::WorkResult>& results)> on_batch;
  /// A request waited this long to be batched.
  std::function<void(double seconds)> on_queue_wait;
  /// A request with rollout logprobs was answered: its lm_head (empty for
  /// logits) and what server/core/rollout_mismatch.h measured.
  std::function<void(const std::string& head, const RolloutObservation& seen)> on_rollout_mismatch;
};

/// The workers a core drives: how many, whether they share this host
/// (shared-memory payloads, CUDA IPC inputs) and how a plan runs on them
/// (WorkerPool::Run in the server; an in-process runner in tests).
struct CoreWorkers {
  int size = 1;
  bool same_host = true;
  Batcher::Runner run;
  /// The workers' gradient steps (read and close; its size is set to
  /// `size` by the core). May be empty: ReadHeadGradients /
  /// CloseHeadGradientStep answer UNIMPLEMENTED.
  GradientStepWorkers gradient_steps;
};

/// Validates, admits, batches and answers scoring requests. Thread-safe.
/// Errors: INVALID_ARGUMENT / FAILED_PRECONDITION / NOT_FOUND from input
/// resolution and validation (ResolveInputs, BuildScoreJob),
/// RESOURCE_EXHAUSTED (max_request_bytes, admission), DEADLINE_EXCEEDED /
/// CANCELLED (the call's bounds), UNAVAILABLE when a worker fails.
class ScoringCore {
 public:
  /// `inputs` (the app's, the update protocol's too) resolves requests'
  /// tensors; it outlives the core.
  ScoringCore(CoreWorkers workers, ServiceConfig config, InputResolver& inputs, CoreObservers observers = {});

  /// Scores one request: resolve its inputs, validate, admit, batch
  /// (server/core/batcher.h), answer. Fills *stats if given. The request's
  /// bytes must stay valid until the call returns, and no longer.
  absl::StatusOr<v1::ScoreResponse> Score(const v1::ScoreRequest& req, const CallContext& call,
                                          RequestStats* stats = nullptr);

  /// Full-vocabulary distillation (server/core/distill_job.h): validate,
  /// bind both heads, admit, run one item per worker (not batched),
  /// answer. The request must stay valid until the call returns. Errors as
  /// BuildDistillJob's, RESOURCE_EXHAUSTED (admission), DEADLINE_EXCEEDED /
  /// CANCELLED, the workers' (UNAVAILABLE when one fails). Fills *rows
  /// with the request's rows when given.
  absl::StatusOr<v1::DistillResponse> Distill(const v1::DistillRequest& req, const CallContext& call,
                                              int64_t* rows = nullptr);

  /// The serving configuration (GetServerInfo).
  v1::ServerInfo Info() const;

  /// A gradient step's lm_head sums, in pieces, and its close
  /// (server/core/head_gradients.h): NOT_FOUND without lm_heads,
  /// UNIMPLEMENTED without CoreWorkers::gradient_steps; else theirs.
  absl::Status ReadHeadGradients(const v1::ReadHeadGradientsRequest& req,
                                 const std::function<bool(const v1::HeadGradientsChunk&)>& write) const;
  absl::Status CloseHeadGradientStep(const v1::CloseHeadGradientStepRequest& req) const;

  /// Admitted, unanswered work (ScoreChunked holds its announced bytes
  /// here while the pieces arrive).
  Admission& admission() { return admission_; }
  const ServiceConfig& config() const { return config_; }
  /// Idle payload regions kept for reuse, bytes.
  int64_t payload_idle_bytes() const { return payload_pool_.idle_bytes(); }

 private:
  const ServiceConfig config_;
  const int workers_;
  const GradientStepWorkers gradient_steps_;  // its size: workers_
  InputResolver& inputs_;
  const CoreObservers observers_;
  Admission admission_;
  PayloadPool payload_pool_;
  Batcher batcher_;
  const Batcher::Runner run_;  // the workers' runner (distillation runs one plan, not batched)
  std::atomic<uint64_t> next_job_id_{1};
};

}  // namespace logprob
