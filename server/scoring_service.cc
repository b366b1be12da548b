#include "server/scoring_service.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/input_kind.h"
#include "common/shared_memory.h"
#include "common/status_macros.h"
#include "server/cuda_ipc_inputs.h"
#include "server/request_inputs.h"
#include "server/response_builder.h"
#include "server/shm_session.h"

namespace logprob {

namespace {

Batcher::Options BatcherOptions(const WorkerPool& pool, const ServiceConfig& config, PayloadPool* payload_pool,
                                Metrics* metrics) {
  Batcher::Options o;
  o.max_queue_delay = config.max_queue_delay;
  o.max_batch_tokens = config.max_batch_tokens;
  o.workers = pool.size();
  o.parallelism = config.parallelism;
  if (config.shared_memory && pool.same_host()) o.payload_pool = payload_pool;
  if (metrics) {
    o.on_queue_change = [metrics](int64_t queued) { metrics->SetQueued(queued); };
    o.on_running_change = [metrics](int64_t running) { metrics->SetRunningBatches(running); };
    o.on_batch = [metrics](const Batcher::Outcome& batch, const std::vector<internal::v1::WorkResult>& results) {
      Metrics::BatchStats stats;
      stats.run_seconds = batch.run_seconds;
      stats.rows = batch.batch_tokens;
      stats.requests = batch.batch_requests;
      for (size_t i = 0; i < results.size(); ++i) {
        stats.compute_seconds = std::max(stats.compute_seconds, results[i].compute_seconds());
        stats.collective_seconds = std::max(stats.collective_seconds, results[i].collective_seconds());
        if (results[i].device_memory_bytes() > 0)
          metrics->SetGpuMemory(batch.plan->items[i].worker, results[i].device_memory_bytes());
      }
      metrics->ObserveBatch(stats);
    };
  }
  return o;
}

}  // namespace

ScoringService::ScoringService(WorkerPool& pool, ServiceConfig config, Metrics* metrics)
    : pool_(pool),
      config_(std::move(config)),
      metrics_(metrics),
      admission_(config_.max_queue_tokens, config_.max_queue_bytes,
                 [metrics](int64_t requests, int64_t tokens) {
                   if (metrics) metrics->SetLoad(requests, tokens);
                 }),
      batcher_(BatcherOptions(pool, config_, &payload_pool_, metrics),
               [&pool](const Plan& plan, const RunBounds& bounds) { return pool.Run(plan, bounds); }),
      assembly_buffers_(config_.max_request_bytes) {
  MarkMethodStreamed(chunked::ScoreChunkedMethodIndex(), chunked::NewChunkedHandler(this));
  if (config_.shared_memory_inputs) {
    ClientRegions::Options o = config_.shared_memory_regions;
    if (metrics) o.on_change = [metrics](int64_t regions, int64_t bytes) { metrics->SetSharedMemory(regions, bytes); };
    regions_ = std::make_unique<ClientRegions>(std::move(o));
  }
  cuda_ipc_.flag = config_.cuda_ipc_inputs;
  cuda_ipc_.cuda_workers = config_.backend == "cuda";
  cuda_ipc_.same_host = pool.same_host();
  cuda_ipc_.workers = pool.size();
  cuda_ipc_.comm = config_.comm;
  cuda_ipc_.one_pass = CanScoreInOnePass(pool.size(), /*device_collectives=*/config_.comm == "nccl");
  if (regions_ || cuda_ipc_.available()) host_id_ = SharedMemoryHostId();
}

absl::StatusOr<v1::ScoreResponse> ScoringService::ScoreOne(const v1::ScoreRequest& req, RequestStats* stats,
                                                           grpc::ServerContext* ctx) {
  // Every tensor's bytes as a source (inline, pieces, shared memory, CUDA IPC).
  InputContext input_context;
  input_context.regions = regions_.get();
  if (ctx != nullptr) {
    input_context.session = [ctx] { return SharedMemoryOwner(*ctx); };
    input_context.peer = ctx->peer();
  }
  input_context.cuda_ipc = cuda_ipc_;
  LOGPROB_ASSIGN_OR_RETURN(RequestInputs inputs, ResolveInputs(req, input_context));
  const int64_t request_bytes = static_cast<int64_t>(req.ByteSizeLong()) + inputs.referenced_bytes;
  if (inputs.referenced_bytes > 0 && request_bytes > config_.max_request_bytes)
    return absl::ResourceExhaustedError(absl::StrCat("request of ", request_bytes,
                                                     " bytes (referenced tensors included) exceeds the server's "
                                                     "max_request_bytes ",
                                                     config_.max_request_bytes));
  LOGPROB_ASSIGN_OR_RETURN(ScoreJob built, BuildScoreJob(req, config_.limits, config_.lm_head, &inputs));
  // Shared with the batch that runs it (server/batcher.h, Lifetimes).
  const auto shared_job = std::make_shared<const ScoreJob>(std::move(built));
  const ScoreJob& job = *shared_job;
  // Scored rows (a job of every input row computes the unscored ones too).
  if (stats) stats->rows = std::count_if(job.out_pos.begin(), job.out_pos.end(), [](int64_t o) { return o >= 0; });
  LOGPROB_ASSIGN_OR_RETURN(const auto ticket, admission_.Admit(job.num_rows(), request_bytes));
  RunBounds bounds;
  if (ctx) {
    bounds.deadline = ctx->deadline();
    bounds.cancelled = [ctx] { return ctx->IsCancelled(); };
  }
  LOGPROB_ASSIGN_OR_RETURN(const Batcher::Outcome batch, batcher_.Run(shared_job, next_job_id_++, bounds));
  // A client that shrank its region while the batch was planned: its rows were zeros.
  LOGPROB_RETURN_IF_ERROR(job.ReadStatus());
  if (metrics_) metrics_->ObserveQueue(batch.queue_seconds);
  if (stats) {
    stats->queue_seconds = batch.queue_seconds;
    stats->batch_requests = batch.batch_requests;
  }
  LOGPROB_ASSIGN_OR_RETURN(v1::ScoreResponse resp, BuildResponse(job, *batch.plan, *batch.results, batch.row_begin));
  resp.set_id(req.id());
  return resp;
}

absl::StatusOr<v1::ScoreResponse> ScoringService::Observe(
    const char* method, const v1::ScoreRequest& req,
    const std::function<absl::StatusOr<v1::ScoreResponse>(RequestStats*)>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  RequestStats stats;
  auto resp = fn(&stats);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t tokens = resp.ok() ? stats.rows : 0;
  const std::string code = absl::StatusCodeToString(resp.status().code());
  if (metrics_) {
    metrics_->ObserveRequestBytes(method, static_cast<int64_t>(req.ByteSizeLong()));
    metrics_->ObserveRequest(method, code, secs, tokens);
  }
  std::clog << "request id=" << req.id() << " method=" << method << " tokens=" << tokens << " seconds=" << secs
            << " queue_seconds=" << stats.queue_seconds << " batch_requests=" << stats.batch_requests
            << (stats.receive_seconds > 0 ? " receive_seconds=" + std::to_string(stats.receive_seconds) : "")
            << " status=" << code << (resp.ok() ? "" : " message=\"" + std::string(resp.status().message()) + "\"")
            << std::endl;
  return resp;
}

grpc::Status ScoringService::Authorize(const grpc::ServerContext* context, const char* method) {
  if (config_.auth == nullptr) return grpc::Status::OK;
  grpc::Status st = config_.auth->Check(*context);
  if (!st.ok()) {
    const std::string code = absl::StatusCodeToString(absl::StatusCode::kUnauthenticated);
    if (metrics_) metrics_->ObserveRequest(method, code, 0, 0);
    std::clog << "request method=" << method << " peer=" << context->peer() << " status=" << code << " message=\""
              << st.error_message() << "\"" << std::endl;
  }
  return st;
}

grpc::Status ScoringService::Score(grpc::ServerContext* context, const v1::ScoreRequest* req, v1::ScoreResponse* resp) {
  LOGPROB_RETURN_IF_ERROR(Authorize(context, "Score"));
  auto r = Observe("Score", *req, [&](RequestStats* stats) { return ScoreOne(*req, stats, context); });
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ScoringService::ScoreStream(grpc::ServerContext* context,
                                         grpc::ServerReaderWriter<v1::ScoreResponse, v1::ScoreRequest>* stream) {
  LOGPROB_RETURN_IF_ERROR(Authorize(context, "ScoreStream"));
  // Messages are scored concurrently (so they can share worker batches),
  // up to kStreamInFlight at a time; a writer thread answers in order.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::future<v1::ScoreResponse>> answers;  // in request order
  bool reading_done = false, write_failed = false;
  std::thread writer([&] {
    for (;;) {
      std::future<v1::ScoreResponse> next;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !answers.empty() || reading_done; });
        if (answers.empty()) return;
        next = std::move(answers.front());
        answers.pop_front();
        cv.notify_all();
      }
      const v1::ScoreResponse resp = next.get();
      // Write without the lock, so the reader can queue more messages
      // meanwhile (only this thread sets write_failed).
      if (!write_failed && !stream->Write(resp)) {
        std::lock_guard<std::mutex> lock(mu);
        write_failed = true;
        cv.notify_all();
      }
    }
  });
  for (;;) {
    auto req = std::make_shared<v1::ScoreRequest>();
    if (!stream->Read(req.get())) break;
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return static_cast<int>(answers.size()) < kStreamInFlight || write_failed; });
    if (write_failed) break;
    answers.push_back(std::async(std::launch::async, [this, req, context] { return AnswerStreamed(*req, context); }));
    cv.notify_all();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    reading_done = true;
    cv.notify_all();
  }
  writer.join();
  return grpc::Status::OK;
}

v1::ScoreResponse ScoringService::AnswerStreamed(const v1::ScoreRequest& req, grpc::ServerContext* context) {
  auto r = Observe("ScoreStream", req, [&](RequestStats* stats) { return ScoreOne(req, stats, context); });
  if (r.ok()) return *std::move(r);
  v1::ScoreResponse resp;
  resp.set_id(req.id());
  resp.set_status_code(static_cast<int>(r.status().code()));
  resp.set_status_message(std::string(r.status().message()));
  return resp;
}

grpc::Status ScoringService::GetServerInfo(grpc::ServerContext* context, const v1::ServerInfoRequest*,
                                           v1::ServerInfo* info) {
  LOGPROB_RETURN_IF_ERROR(Authorize(context, "GetServerInfo"));
  info->set_version("0.1.0");
  info->set_workers(pool_.size());
  info->set_backend(config_.backend);
  info->set_comm(config_.comm);
  info->set_max_request_bytes(config_.max_request_bytes);
  info->set_max_tokens_per_request(config_.limits.max_tokens);
  info->set_max_topk(config_.limits.max_topk);
  info->set_parallelism(config_.parallelism_name);
  info->set_vocab_size(config_.lm_head.vocab_size);
  info->set_hidden_size(config_.lm_head.hidden_size);
  info->set_lm_head_dtype(config_.lm_head_dtype);
  info->set_lm_head_path(config_.lm_head_path);
  info->set_lm_head_tensor(config_.lm_head_tensor);
  info->set_hidden_chunk_tokens(config_.hidden_chunk_tokens);
  info->set_lm_head_precision(config_.lm_head_precision);
  info->set_max_queue_tokens(config_.max_queue_tokens);
  info->set_max_queue_bytes(config_.max_queue_bytes);
  info->set_max_queue_delay_seconds(std::chrono::duration<double>(config_.max_queue_delay).count());
  info->set_max_batch_tokens(config_.max_batch_tokens);
  info->set_shared_memory_inputs(regions_ != nullptr);
  info->set_cuda_ipc_inputs(cuda_ipc_.available());
  info->set_host_id(host_id_);
  if (regions_) {
    const ClientRegions::Options& o = regions_->options();
    info->set_max_shared_memory_bytes(o.max_bytes);
    info->set_max_shared_memory_regions(o.max_regions);
    info->set_shared_memory_idle_timeout_seconds(std::chrono::duration<double>(o.idle_timeout).count());
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::string> ScoringService::ShmSession(grpc::ServerContext* context, const char* method) {
  if (grpc::Status st = Authorize(context, method); !st.ok()) return FromGrpc(st);
  if (!regions_)
    return absl::FailedPreconditionError(
        "shared-memory inputs are disabled on this server (--shared-memory-inputs=false)");
  return SharedMemoryOwner(*context);
}

namespace {

/// Logs and counts (logprob_requests_total) one shared-memory call and returns its gRPC status.
grpc::Status Logged(Metrics* metrics, const char* method, const std::string& what, const absl::Status& st) {
  if (metrics) metrics->ObserveRequest(method, absl::StatusCodeToString(st.code()), 0, 0);
  std::clog << "request method=" << method << " " << what << " status=" << absl::StatusCodeToString(st.code())
            << (st.ok() ? "" : " message=\"" + std::string(st.message()) + "\"") << std::endl;
  return ToGrpc(st);
}

}  // namespace

grpc::Status ScoringService::RegisterSharedMemory(grpc::ServerContext* context,
                                                  const v1::RegisterSharedMemoryRequest* req,
                                                  v1::RegisterSharedMemoryResponse*) {
  auto session = ShmSession(context, "RegisterSharedMemory");
  const std::string what =
      absl::StrCat("region=", req->name(), " shm_name=", req->shm_name(), " byte_size=", req->byte_size());
  if (!session.ok()) return Logged(metrics_, "RegisterSharedMemory", what, session.status());
  return Logged(metrics_, "RegisterSharedMemory", what,
                regions_->Register(*session, req->name(), req->shm_name(), req->byte_size()));
}

grpc::Status ScoringService::UnregisterSharedMemory(grpc::ServerContext* context,
                                                    const v1::UnregisterSharedMemoryRequest* req,
                                                    v1::UnregisterSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "UnregisterSharedMemory");
  const std::string what = absl::StrCat("region=", req->name());
  if (!session.ok()) return Logged(metrics_, "UnregisterSharedMemory", what, session.status());
  auto n = regions_->Unregister(*session, req->name());
  if (n.ok()) resp->set_unregistered(*n);
  return Logged(metrics_, "UnregisterSharedMemory", what, n.status());
}

grpc::Status ScoringService::ListSharedMemory(grpc::ServerContext* context, const v1::ListSharedMemoryRequest*,
                                              v1::ListSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "ListSharedMemory");
  if (!session.ok()) return ToGrpc(session.status());
  for (const auto& r : regions_->List(*session)) {
    v1::SharedMemoryRegionStatus* out = resp->add_regions();
    out->set_name(r->name());
    out->set_shm_name(r->shm_name());
    out->set_byte_size(r->byte_size());
  }
  return grpc::Status::OK;
}

}  // namespace logprob
