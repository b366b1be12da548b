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
#include "common/error_reason.h"
#include "common/grpc_status.h"
#include "common/input_kind.h"
#include "common/shared_memory.h"
#include "common/status_macros.h"
#include "server/cuda_ipc_inputs.h"
#include "server/request_inputs.h"
#include "server/response_builder.h"
#include "server/shm_session.h"

namespace logprob {

ScoringService::ScoringService(WorkerPool& pool, ServiceConfig config, Metrics* metrics)
    : core_(CoreWorkers{pool.size(), pool.same_host(),
                        [&pool](const Plan& plan, const RunBounds& bounds) { return pool.Run(plan, bounds); }},
            config, metrics),
      auth_(config.auth),
      metrics_(metrics),
      assembly_buffers_(config.max_request_bytes) {
  MarkMethodStreamed(chunked::ScoreChunkedMethodIndex(), chunked::NewChunkedHandler(this));
}

grpc::Status ScoringService::Reply(grpc::ServerContext* ctx, const absl::Status& st) {
  const v1::ErrorReason reason = ReasonOf(st);
  if (reason != v1::ERROR_REASON_UNSPECIFIED)
    ctx->AddTrailingMetadata(kReasonMetadataKey, v1::ErrorReason_Name(reason));
  return ToGrpc(st);
}

absl::StatusOr<v1::ScoreResponse> ScoringService::ScoreOne(const v1::ScoreRequest& req, RequestStats* stats,
                                                           grpc::ServerContext* ctx) {
  CallContext call;
  call.deadline = ctx->deadline();
  call.cancelled = [ctx] { return ctx->IsCancelled(); };
  call.session = [ctx] { return SharedMemoryOwner(*ctx); };
  call.peer = ctx->peer();
  return core_.Score(req, call, stats);
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
  if (auth_ == nullptr) return grpc::Status::OK;
  grpc::Status st = auth_->Check(*context);
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
  if (!r.ok()) return Reply(context, r.status());
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
  resp.set_status_reason(ReasonOf(r.status()));
  return resp;
}

grpc::Status ScoringService::GetServerInfo(grpc::ServerContext* context, const v1::ServerInfoRequest*,
                                           v1::ServerInfo* info) {
  LOGPROB_RETURN_IF_ERROR(Authorize(context, "GetServerInfo"));
  *info = core_.Info();
  return grpc::Status::OK;
}

absl::StatusOr<std::string> ScoringService::ShmSession(grpc::ServerContext* context, const char* method) {
  if (grpc::Status st = Authorize(context, method); !st.ok()) return FromGrpc(st);
  LOGPROB_RETURN_IF_ERROR(core_.SharedMemoryEnabled());
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
                                                  v1::RegisterSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "RegisterSharedMemory");
  const std::string what =
      absl::StrCat("region=", req->name(), " shm_name=", req->shm_name(), " byte_size=", req->byte_size());
  if (!session.ok()) return Logged(metrics_, "RegisterSharedMemory", what, session.status());
  auto r = core_.RegisterSharedMemory(*session, *req);
  if (r.ok()) *resp = *std::move(r);
  return Logged(metrics_, "RegisterSharedMemory", what, r.status());
}

grpc::Status ScoringService::ConfirmSharedMemory(grpc::ServerContext* context,
                                                 const v1::ConfirmSharedMemoryRequest* req,
                                                 v1::ConfirmSharedMemoryResponse*) {
  auto session = ShmSession(context, "ConfirmSharedMemory");
  const std::string what = absl::StrCat("region=", req->name());
  if (!session.ok()) return Logged(metrics_, "ConfirmSharedMemory", what, session.status());
  return Logged(metrics_, "ConfirmSharedMemory", what, core_.ConfirmSharedMemory(*session, req->name()));
}

grpc::Status ScoringService::UnregisterSharedMemory(grpc::ServerContext* context,
                                                    const v1::UnregisterSharedMemoryRequest* req,
                                                    v1::UnregisterSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "UnregisterSharedMemory");
  const std::string what = absl::StrCat("region=", req->name());
  if (!session.ok()) return Logged(metrics_, "UnregisterSharedMemory", what, session.status());
  auto n = core_.UnregisterSharedMemory(*session, req->name());
  if (n.ok()) resp->set_unregistered(*n);
  return Logged(metrics_, "UnregisterSharedMemory", what, n.status());
}

grpc::Status ScoringService::ListSharedMemory(grpc::ServerContext* context, const v1::ListSharedMemoryRequest*,
                                              v1::ListSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "ListSharedMemory");
  if (!session.ok()) return ToGrpc(session.status());
  auto regions = core_.ListSharedMemory(*session);
  if (!regions.ok()) return ToGrpc(regions.status());
  for (const auto& [r, confirmed] : *regions) {
    v1::SharedMemoryRegionStatus* out = resp->add_regions();
    out->set_name(r->name());
    out->set_shm_name(r->shm_name());
    out->set_byte_size(r->byte_size());
    out->set_confirmed(confirmed);
  }
  return grpc::Status::OK;
}

}  // namespace logprob
