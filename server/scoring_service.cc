#include "server/scoring_service.h"

#include <algorithm>
#include <chrono>
#include <iostream>

#include "absl/status/status.h"
#include "common/grpc_status.h"
#include "server/response_builder.h"

namespace logprob {

ScoringService::ScoringService(WorkerPool& pool, ServiceConfig config, Metrics* metrics)
    : pool_(pool),
      config_(std::move(config)),
      metrics_(metrics),
      admission_(config_.max_queue_tokens, config_.max_queue_bytes, [metrics](int64_t requests, int64_t tokens) {
        if (metrics) metrics->SetLoad(requests, tokens);
      }) {}

absl::StatusOr<v1::ScoreResponse> ScoringService::ScoreOne(const v1::ScoreRequest& req, int64_t* scored_rows,
                                                           grpc::ServerContext* ctx) {
  auto job = BuildScoreJob(req, config_.limits, config_.lm_head);
  if (!job.ok()) return job.status();
  if (scored_rows) *scored_rows = job->num_rows();
  auto ticket = admission_.Admit(job->num_rows(), static_cast<int64_t>(req.ByteSizeLong()));
  if (!ticket.ok()) return ticket.status();
  const Plan plan = PlanWork(*job, pool_.size(), config_.parallelism, next_job_id_++);
  const auto t0 = std::chrono::steady_clock::now();
  auto results = pool_.Run(plan, ctx);
  if (!results.ok()) return results.status();
  if (metrics_) {
    const double run_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double compute_secs = 0;
    for (const auto& r : *results) compute_secs = std::max(compute_secs, r.compute_seconds());
    metrics_->ObserveDispatch(run_secs, compute_secs, job->num_rows());
  }
  auto resp = BuildResponse(*job, plan, *results);
  if (!resp.ok()) return resp.status();
  resp->set_id(req.id());
  return resp;
}

namespace {

/// Runs `fn` (which reports the rows it scored), records metrics and logs one line for the request.
template <typename Fn>
absl::StatusOr<v1::ScoreResponse> Observed(Metrics* metrics, const char* method, const v1::ScoreRequest& req, Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  if (metrics) metrics->ObserveRequestBytes(method, static_cast<int64_t>(req.ByteSizeLong()));
  int64_t rows = 0;
  auto resp = fn(&rows);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t tokens = resp.ok() ? rows : 0;
  const std::string code = absl::StatusCodeToString(resp.status().code());
  if (metrics) metrics->ObserveRequest(method, code, secs, tokens);
  std::clog << "request id=" << req.id() << " method=" << method << " tokens=" << tokens << " seconds=" << secs
            << " status=" << code << (resp.ok() ? "" : " message=\"" + std::string(resp.status().message()) + "\"")
            << std::endl;
  return resp;
}

}  // namespace

grpc::Status ScoringService::Authorize(const grpc::ServerContext* context, const char* method) {
  if (config_.auth == nullptr) return grpc::Status::OK;
  grpc::Status st = config_.auth->Check(*context);
  if (!st.ok()) {
    const std::string code = absl::StatusCodeToString(absl::StatusCode::kUnauthenticated);
    if (metrics_) metrics_->ObserveRequest(method, code, 0, 0);
    std::clog << "request method=" << method << " peer=" << context->peer() << " status=" << code
              << " message=\"" << st.error_message() << "\"" << std::endl;
  }
  return st;
}

grpc::Status ScoringService::Score(grpc::ServerContext* context, const v1::ScoreRequest* req, v1::ScoreResponse* resp) {
  if (grpc::Status st = Authorize(context, "Score"); !st.ok()) return st;
  auto r = Observed(metrics_, "Score", *req, [&](int64_t* rows) { return ScoreOne(*req, rows, context); });
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ScoringService::ScoreStream(grpc::ServerContext* context,
                                         grpc::ServerReaderWriter<v1::ScoreResponse, v1::ScoreRequest>* stream) {
  if (grpc::Status st = Authorize(context, "ScoreStream"); !st.ok()) return st;
  v1::ScoreRequest req;
  while (stream->Read(&req)) {
    auto r = Observed(metrics_, "ScoreStream", req, [&](int64_t* rows) { return ScoreOne(req, rows, context); });
    v1::ScoreResponse resp;
    if (r.ok()) {
      resp = std::move(*r);
    } else {
      resp.set_id(req.id());
      resp.set_status_code(static_cast<int>(r.status().code()));
      resp.set_status_message(std::string(r.status().message()));
    }
    if (!stream->Write(resp)) break;
  }
  return grpc::Status::OK;
}

grpc::Status ScoringService::GetServerInfo(grpc::ServerContext* context, const v1::ServerInfoRequest*,
                                           v1::ServerInfo* info) {
  if (grpc::Status st = Authorize(context, "GetServerInfo"); !st.ok()) return st;
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
  return grpc::Status::OK;
}

}  // namespace logprob
