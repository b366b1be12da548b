#include "server/core/scoring_core.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/chunk_codec.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "server/core/response_builder.h"
#include "server/inputs/request_inputs.h"

namespace logprob {
namespace {

Batcher::Options BatcherOptions(const CoreWorkers& workers, const ServiceConfig& config, PayloadPool* payload_pool,
                                const CoreObservers& observers) {
  Batcher::Options o;
  o.max_queue_delay = config.max_queue_delay;
  o.max_batch_tokens = config.max_batch_tokens;
  o.workers = workers.size;
  o.parallelism = config.parallelism;
  if (config.shared_memory && workers.same_host) o.payload_pool = payload_pool;
  o.on_queue_change = observers.on_queued;
  o.on_running_change = observers.on_running;
  o.on_batch = observers.on_batch;
  return o;
}

// Several heads and none named "default": vocab_size / hidden_size are the
// [V, H] every head shares (hidden states of that H can go to any of them),
// 0 when they differ; the other single-head fields stay empty.
void SetSharedHeadShape(v1::ServerInfo* info) {
  if (info->lm_heads().empty()) return;
  const v1::LmHeadInfo& first = info->lm_heads(0);
  for (const v1::LmHeadInfo& h : info->lm_heads())
    if (h.vocab_size() != first.vocab_size() || h.hidden_size() != first.hidden_size()) return;
  info->set_vocab_size(first.vocab_size());
  info->set_hidden_size(first.hidden_size());
}

}  // namespace

ScoringCore::ScoringCore(CoreWorkers workers, ServiceConfig config, InputResolver& inputs, CoreObservers observers)
    : config_(std::move(config)),
      workers_(workers.size),
      gradient_steps_(GradientStepWorkers{workers.size, workers.gradient_steps.read, workers.gradient_steps.close}),
      inputs_(inputs),
      observers_(std::move(observers)),
      admission_(config_.max_queue_tokens, config_.max_queue_bytes, observers_.on_load),
      payload_pool_(/*max_idle=*/4, static_cast<int64_t>(PayloadPool::RegionSize(
                                        static_cast<size_t>(config_.max_request_bytes)))),  // FrontendMemoryBound
      batcher_(BatcherOptions(workers, config_, &payload_pool_, observers_), workers.run),
      run_(workers.run) {}

absl::StatusOr<v1::DistillResponse> ScoringCore::Distill(const v1::DistillRequest& req, const CallContext& call,
                                                         int64_t* rows) {
  // One rule for names, in updates and requests: nothing else is looked up or echoed.
  if (!req.student_head().empty()) LOGPROB_RETURN_IF_ERROR(CheckLmHeadName(req.student_head(), "student_head"));
  if (!req.teacher_head().empty()) LOGPROB_RETURN_IF_ERROR(CheckLmHeadName(req.teacher_head(), "teacher_head"));
  if (!req.student_head_version().empty())
    LOGPROB_RETURN_IF_ERROR(CheckLmHeadVersionName(req.student_head_version(), "student_head_version"));
  if (!req.teacher_head_version().empty())
    LOGPROB_RETURN_IF_ERROR(CheckLmHeadVersionName(req.teacher_head_version(), "teacher_head_version"));
  const int64_t request_bytes = static_cast<int64_t>(req.ByteSizeLong());
  if (request_bytes > config_.max_request_bytes)
    return absl::ResourceExhaustedError(absl::StrCat(
        "request of ", request_bytes, " bytes exceeds the server's max_request_bytes ", config_.max_request_bytes));
  if (config_.lm_heads_ready && config_.lm_heads && !config_.lm_heads->empty())
    LOGPROB_RETURN_IF_ERROR(config_.lm_heads_ready());
  const LmHeads* heads = config_.lm_heads != nullptr && !config_.lm_heads->empty() ? config_.lm_heads : nullptr;
  LOGPROB_ASSIGN_OR_RETURN(const DistillJob job, BuildDistillJob(req, heads, config_.limits));
  if (rows) *rows = job.rows;
  Admission::Ticket own;
  Admission::Ticket* ticket = call.received != nullptr ? call.received : &own;
  LOGPROB_RETURN_IF_ERROR(
      admission_.Resize(ticket, job.rows, std::max(request_bytes, ticket->bytes()) + job.working_bytes(workers_)));
  std::vector<internal::v1::WorkResult> results;
  if (job.rows > 0) {
    RunBounds bounds;
    bounds.deadline = call.deadline;
    bounds.cancelled = call.cancelled;
    const Plan plan = PlanDistillation(job, workers_, next_job_id_++);
    LOGPROB_ASSIGN_OR_RETURN(results, run_(plan, bounds));
  }
  return DistillResponseOf(req.id(), job, results);
}

absl::Status ScoringCore::ReadHeadGradients(const v1::ReadHeadGradientsRequest& req,
                                            const std::function<bool(const v1::HeadGradientsChunk&)>& write) const {
  if (config_.lm_heads == nullptr || config_.lm_heads->empty())
    return absl::NotFoundError("this server holds no lm_head, so no gradient step");
  if (!gradient_steps_.read) return absl::UnimplementedError("these workers keep no gradient steps");
  return logprob::ReadHeadGradients(*config_.lm_heads, gradient_steps_, req, write);
}

absl::Status ScoringCore::CloseHeadGradientStep(const v1::CloseHeadGradientStepRequest& req) const {
  if (!gradient_steps_.close) return absl::UnimplementedError("these workers keep no gradient steps");
  return logprob::CloseHeadGradientStep(gradient_steps_, req);
}

absl::StatusOr<v1::ScoreResponse> ScoringCore::Score(const v1::ScoreRequest& req, const CallContext& call,
                                                     RequestStats* stats) {
  // Every tensor's bytes as a source (inline, pieces, shared memory, CUDA IPC).
  LOGPROB_ASSIGN_OR_RETURN(RequestInputs inputs, inputs_.Resolve(req, call.caller));
  const int64_t request_bytes = static_cast<int64_t>(req.ByteSizeLong()) + inputs.referenced_bytes;
  if (inputs.referenced_bytes > 0 && request_bytes > config_.max_request_bytes)
    return absl::ResourceExhaustedError(absl::StrCat("request of ", request_bytes,
                                                     " bytes (referenced tensors included) exceeds the server's "
                                                     "max_request_bytes ",
                                                     config_.max_request_bytes));
  // Hidden states: the lm_head version this request is scored with, bound
  // now (admission) whatever commits while it waits or runs.
  const bool hidden = std::any_of(req.inputs().begin(), req.inputs().end(),
                                  [](const v1::Tensor& t) { return t.name() == "hidden_states"; });
  std::shared_ptr<const LmHeadVersion> head;
  LmHeadShape shape;
  if (!hidden && (!req.head().empty() || !req.head_version().empty()))
    return absl::InvalidArgumentError("head / head_version select an lm_head for hidden_states; this request has none");
  // One rule for names, in updates and requests: nothing else is looked up or echoed.
  if (!req.head().empty()) LOGPROB_RETURN_IF_ERROR(CheckLmHeadName(req.head(), "head"));
  if (!req.head_version().empty()) LOGPROB_RETURN_IF_ERROR(CheckLmHeadVersionName(req.head_version(), "head_version"));
  if (hidden && config_.lm_heads && !config_.lm_heads->empty()) {
    if (config_.lm_heads_ready) LOGPROB_RETURN_IF_ERROR(config_.lm_heads_ready());
    LOGPROB_ASSIGN_OR_RETURN(head, config_.lm_heads->Bind(req.head(), req.head_version()));
    shape = {head->source.vocab_size, head->source.hidden_size};
  }
  LOGPROB_ASSIGN_OR_RETURN(ScoreJob built, BuildScoreJob(req, config_.limits, shape, &inputs));
  built.lm_head = head;
  // Shared with the batch that runs it (server/core/batcher.h, Lifetimes).
  const auto shared_job = std::make_shared<const ScoreJob>(std::move(built));
  const ScoreJob& job = *shared_job;
  // Scored rows (a job of every input row computes the unscored ones too).
  if (stats) stats->rows = std::count_if(job.out_pos.begin(), job.out_pos.end(), [](int64_t o) { return o >= 0; });
  Admission::Ticket own;
  Admission::Ticket* ticket = call.received != nullptr ? call.received : &own;
  // The request's bytes (or what it reserved before its body was read),
  // plus the copies of its sampling masks the front-end makes.
  LOGPROB_RETURN_IF_ERROR(admission_.Resize(
      ticket, job.num_rows(),
      std::max(request_bytes, ticket->bytes()) + job.mask_working_bytes(workers_) + job.backward_working_bytes()));
  RunBounds bounds;
  bounds.deadline = call.deadline;
  bounds.cancelled = call.cancelled;
  absl::StatusOr<Batcher::Outcome> ran = batcher_.Run(shared_job, next_job_id_++, bounds);
  // A worker's error keeps the worker's reason: CUDA_IPC_UNAVAILABLE only
  // when a worker could not open the client's handle (the client then sends
  // bytes), never for other FAILED_PRECONDITIONs such as a missing head.
  if (!ran.ok()) return ran.status();
  const Batcher::Outcome& batch = *ran;
  // A client that shrank its region while the batch was planned: its rows were zeros.
  LOGPROB_RETURN_IF_ERROR(job.ReadStatus());
  if (observers_.on_queue_wait) observers_.on_queue_wait(batch.queue_seconds);
  if (stats) {
    stats->queue_seconds = batch.queue_seconds;
    stats->batch_requests = batch.batch_requests;
  }
  LOGPROB_ASSIGN_OR_RETURN(v1::ScoreResponse resp, BuildResponse(job, *batch.plan, *batch.results, batch.row_begin));
  resp.set_id(req.id());
  if (job.lm_head) {
    LOGPROB_RETURN_IF_ERROR(CheckFiniteHiddenOutputs(resp, job.out_shape, *job.lm_head));
    resp.set_head(job.lm_head->head);
    resp.set_head_version(job.lm_head->version);
  }
  if (job.rollout) {
    std::vector<bool> scored(static_cast<size_t>(job.num_outputs()), false);
    for (int64_t i = 0; i < job.num_rows(); ++i)
      if (job.out_pos[i] >= 0 && job.targets[i] >= 0) scored[job.out_pos[i]] = true;
    LOGPROB_ASSIGN_OR_RETURN(const RolloutObservation seen, AddRolloutMismatch(*job.rollout, scored, &resp));
    if (observers_.on_rollout_mismatch) observers_.on_rollout_mismatch(job.lm_head ? job.lm_head->head : "", seen);
  }
  return resp;
}

v1::ServerInfo ScoringCore::Info() const {
  v1::ServerInfo info;
  info.set_version(kVersion);
  info.set_workers(workers_);
  info.set_backend(config_.backend);
  info.set_comm(config_.comm);
  info.set_max_request_bytes(config_.max_request_bytes);
  info.set_max_tokens_per_request(config_.limits.max_tokens);
  info.set_max_topk(config_.limits.max_topk);
  info.set_parallelism(config_.parallelism_name);
  if (config_.lm_heads) {
    // The single-head fields describe "default", or the only head.
    absl::StatusOr<std::shared_ptr<const LmHeadVersion>> head = config_.lm_heads->Bind("", "");
    if (head.ok()) {
      const LmHeadSource& src = (*head)->source;
      info.set_vocab_size(src.vocab_size);
      info.set_hidden_size(src.hidden_size);
      info.set_lm_head_dtype(DTypeName(src.dtype));
      info.set_lm_head_path(src.file);
      info.set_lm_head_tensor(src.tensor);
      if (config_.lm_head_precision) info.set_lm_head_precision(config_.lm_head_precision(src.dtype));
    }
    for (v1::LmHeadInfo& h : config_.lm_heads->List()) *info.add_lm_heads() = std::move(h);
    if (!head.ok()) SetSharedHeadShape(&info);
  }
  info.set_lm_head_cpu_kernel(config_.lm_head_cpu_kernel);
  info.set_lm_head_updates(config_.lm_head_updates);
  if (config_.lm_head_store_bytes) info.set_lm_head_store_bytes(config_.lm_head_store_bytes());
  info.set_hidden_chunk_tokens(config_.hidden_chunk_tokens);
  info.set_max_queue_tokens(config_.max_queue_tokens);
  info.set_max_queue_bytes(config_.max_queue_bytes);
  info.set_max_queue_delay_seconds(std::chrono::duration<double>(config_.max_queue_delay).count());
  info.set_max_batch_tokens(config_.max_batch_tokens);
  info.set_chunked_piece_bytes(chunked::kDefaultPieceBytes);
  info.set_chunked_inline_bytes(chunked::kDefaultInlineBytes);
  inputs_.Describe(&info);
  return info;
}

}  // namespace logprob
