#include "server/transport/scoring_service.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/chunk_assembler.h"
#include "common/error_reason.h"
#include "common/grpc_status.h"
#include "common/input_kind.h"
#include "common/log_line.h"
#include "common/parsed_requests.h"
#include "common/request_bytes.h"
#include "common/shared_memory.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "server/core/response_builder.h"
#include "server/heads/lm_head_reader.h"
#include "server/inputs/cuda_ipc_inputs.h"
#include "server/inputs/request_inputs.h"
#include "server/transport/call_ended.h"
#include "server/transport/shm_session.h"

namespace logprob {

namespace {

/// The core's observations as metrics (nothing without `metrics`).
CoreObservers CoreObserversOf(Metrics* metrics) {
  CoreObservers o;
  if (!metrics) return o;
  o.on_load = [metrics](int64_t requests, int64_t tokens, int64_t bytes) { metrics->SetLoad(requests, tokens, bytes); };
  o.on_queued = [metrics](int64_t queued) { metrics->SetQueued(queued); };
  o.on_running = [metrics](int64_t running) { metrics->SetRunningBatches(running); };
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
  o.on_queue_wait = [metrics](double seconds) { metrics->ObserveQueue(seconds); };
  o.on_rollout_mismatch = [metrics](const std::string& head, const RolloutObservation& seen) {
    metrics->ObserveRolloutMismatch(head, seen.log_ratios, seen.outside_band, seen.k3);
  };
  return o;
}

}  // namespace

ScoringService::ScoringService(WorkerPool& pool, ServiceConfig config, InputResolver& inputs, Metrics* metrics,
                               LmHeadUpdates* updates, AccessPolicy access)
    : inputs_(inputs),
      core_(CoreWorkers{pool.size(), pool.same_host(),
                        [&pool](const Plan& plan, const RunBounds& bounds) { return pool.Run(plan, bounds); },
                        GradientStepWorkers{
                            pool.size(),
                            [&pool](int rank, const internal::v1::WorkerHeadGradientsRequest& req) {
                              return pool.ReadHeadGradients(rank, req);
                            },
                            [&pool](const std::string& step) { return pool.CloseHeadGradientStep(step); }}},
            config, inputs, CoreObserversOf(metrics)),
      updates_(updates),
      first_parts_(updates ? std::make_unique<FirstPartWatch>(kPutsAwaitingFirstPart, updates->options().timeout)
                           : nullptr),
      access_(access),
      metrics_(metrics),
      assembly_buffers_(config.max_request_bytes) {
  if (metrics) {
    pool_gauges_.push_back(
        metrics->memory().AddPool("chunk_buffers", [this] { return assembly_buffers_.idle_bytes(); }));
    pool_gauges_.push_back(metrics->memory().AddPool("payload_regions", [this] { return core_.payload_idle_bytes(); }));
  }
  MarkMethodStreamed(chunked::ScoreChunkedMethodIndex(), chunked::NewChunkedHandler(this));
  // The other methods parse their own requests (malformed: INVALID_ARGUMENT).
  using S = ScoringService;
  MarkMethodStreamed(chunked::MethodIndex("Score"),
                     NewParsedUnaryHandler<S, v1::ScoreRequest, v1::ScoreResponse>(this, "Score", &S::ScoreReceived));
  MarkMethodStreamed(chunked::MethodIndex("ScoreStream"),
                     NewParsedBidiHandler(this, "ScoreStream", &S::ServeScoreStream));
  MarkMethodStreamed(chunked::MethodIndex("GetServerInfo"),
                     NewParsedUnaryHandler(this, "GetServerInfo", &S::GetServerInfo));
  MarkMethodStreamed(chunked::MethodIndex("RegisterSharedMemory"),
                     NewParsedUnaryHandler(this, "RegisterSharedMemory", &S::RegisterSharedMemory));
  MarkMethodStreamed(chunked::MethodIndex("UnregisterSharedMemory"),
                     NewParsedUnaryHandler(this, "UnregisterSharedMemory", &S::UnregisterSharedMemory));
  MarkMethodStreamed(chunked::MethodIndex("ListSharedMemory"),
                     NewParsedUnaryHandler(this, "ListSharedMemory", &S::ListSharedMemory));
  MarkMethodStreamed(chunked::MethodIndex("ConfirmSharedMemory"),
                     NewParsedUnaryHandler(this, "ConfirmSharedMemory", &S::ConfirmSharedMemory));
  MarkMethodStreamed(chunked::MethodIndex("BeginLmHeadUpdate"),
                     NewParsedUnaryHandler(this, "BeginLmHeadUpdate", &S::BeginLmHeadUpdate));
  MarkMethodStreamed(chunked::MethodIndex("CommitLmHeadUpdate"),
                     NewParsedUnaryHandler(this, "CommitLmHeadUpdate", &S::CommitLmHeadUpdate));
  MarkMethodStreamed(chunked::MethodIndex("AbortLmHeadUpdate"),
                     NewParsedUnaryHandler(this, "AbortLmHeadUpdate", &S::AbortLmHeadUpdate));
  MarkMethodStreamed(chunked::MethodIndex("ReadLmHeadRows"),
                     NewParsedServerStreamingHandler(this, "ReadLmHeadRows", &S::ServeReadLmHeadRows));
  MarkMethodStreamed(chunked::MethodIndex("CloseHeadGradientStep"),
                     NewParsedUnaryHandler(this, "CloseHeadGradientStep", &S::CloseHeadGradientStep));
  MarkMethodStreamed(chunked::MethodIndex("Distill"), NewParsedUnaryHandler(this, "Distill", &S::Distill));
  MarkMethodStreamed(chunked::MethodIndex("ReadHeadGradients"),
                     NewParsedServerStreamingHandler(this, "ReadHeadGradients", &S::ServeReadHeadGradients));
  MarkMethodStreamed(chunked::MethodIndex("PutLmHeadRows"),
                     new grpc::internal::BidiStreamingHandler<ScoringService, chunked::IncomingPart, v1::LmHeadUpdate>(
                         [](ScoringService* s, grpc::ServerContext* context,
                            grpc::ServerReaderWriter<v1::LmHeadUpdate, chunked::IncomingPart>* stream) {
                           return s->ServeLmHeadRows(context, stream);
                         },
                         this));
}

grpc::Status ScoringService::Reply(grpc::ServerContext* ctx, const absl::Status& st) {
  return ReplyWithReason(ctx, st);
}

absl::StatusOr<v1::ScoreResponse> ScoringService::ScoreOne(const v1::ScoreRequest& req, RequestStats* stats,
                                                           grpc::ServerContext* ctx, Receipt* received) {
  CallContext call;
  call.received = received;
  call.deadline = ctx->deadline();
  call.cancelled = [ctx] { return ctx->IsCancelled(); };
  call.caller.session = [ctx] { return SharedMemoryOwner(*ctx); };
  call.caller.peer = ctx->peer();
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
  LogLine() << "request id=" << Printable(req.id()) << " method=" << method << " tokens=" << tokens
            << " seconds=" << secs << " queue_seconds=" << stats.queue_seconds
            << " batch_requests=" << stats.batch_requests
            << (stats.receive_seconds > 0 ? " receive_seconds=" + std::to_string(stats.receive_seconds) : "")
            << " status=" << code << (resp.ok() ? "" : " message=\"" + Printable(resp.status().message(), 1024) + "\"");
  return resp;
}

grpc::Status ScoringService::Authorize(const grpc::ServerContext* context, const char* method, Right right) {
  if (access_.open()) return grpc::Status::OK;
  grpc::Status st = access_.Check(*context, right, method);
  return st.ok() ? st : Refused(context, method, st);
}

grpc::Status ScoringService::Score(grpc::ServerContext* context, const v1::ScoreRequest* req, v1::ScoreResponse* resp) {
  return ScoreReceived(context, req, resp, nullptr);
}

grpc::Status ScoringService::ScoreReceived(grpc::ServerContext* context, const v1::ScoreRequest* req,
                                           v1::ScoreResponse* resp, Receipt* received) {
  LOGPROB_RETURN_IF_ERROR(Authorize(context, "Score"));
  auto r = Observe("Score", *req, [&](RequestStats* stats) { return ScoreOne(*req, stats, context, received); });
  if (!r.ok()) return Reply(context, r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

grpc::Status ScoringService::ScoreStream(grpc::ServerContext* context,
                                         grpc::ServerReaderWriter<v1::ScoreResponse, v1::ScoreRequest>* stream) {
  return ServeScoreStream(context, stream);
}

grpc::Status ScoringService::Refused(const grpc::ServerContext* context, const char* method, const grpc::Status& st) {
  const std::string code = absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code()));
  if (metrics_) metrics_->ObserveRequest(method, code, 0, 0);
  LogLine() << "request method=" << method << " peer=" << context->peer() << " status=" << code << " message=\""
            << Printable(st.error_message(), 1024) << "\"";
  return st;
}

absl::StatusOr<std::optional<int64_t>> ScoringService::AnnouncedBytes(const grpc::ServerContext& context) const {
  const int64_t most = core_.config().max_request_bytes;
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find(kRequestBytesMetadataKey);
  if (it == metadata.end()) return std::nullopt;
  const absl::string_view value(it->second.data(), it->second.size());
  int64_t bytes = 0;
  if (!absl::SimpleAtoi(value, &bytes) || bytes < 0 || value.find_first_not_of("0123456789") != std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat("metadata ", kRequestBytesMetadataKey, " \"", Printable(value, 64),
                                                   "\": the request's size in bytes expected"));
  if (bytes > most)
    return absl::ResourceExhaustedError(absl::StrCat("request of ", bytes, " bytes (metadata ",
                                                     kRequestBytesMetadataKey,
                                                     ") exceeds the server's max_request_bytes ", most));
  return bytes;
}

grpc::Status ScoringService::Reserve(grpc::ServerContext* context, const char* method, Receipt* receipt) {
  if (std::strcmp(method, "Score") != 0) return grpc::Status::OK;
  if (!access_.open())
    if (grpc::Status st = access_.Check(*context, Right::kScore, method); !st.ok()) return st;
  const absl::StatusOr<std::optional<int64_t>> announced = AnnouncedBytes(*context);
  if (!announced.ok()) return Reply(context, announced.status());
  // Unannounced, the largest size is held for the read only: the next such
  // call waits a little for it (kUnannouncedWait) rather than being refused.
  const absl::Status st = announced->has_value()
                              ? core_.admission().Resize(receipt, 0, **announced)
                              : core_.admission().ResizeWaiting(
                                    receipt, 0, core_.config().max_request_bytes,
                                    std::min(absl::FromChrono(context->deadline()), absl::Now() + kUnannouncedWait));
  return st.ok() ? grpc::Status::OK : Reply(context, st);
}

absl::Status ScoringService::ReserveStreamed(grpc::ServerContext* context, int64_t bytes, bool answering,
                                             Receipt* receipt) {
  const absl::Time deadline = absl::FromChrono(context->deadline());
  const absl::Time idle_until = std::min(deadline, absl::Now() + kUnannouncedWait);
  for (;;) {
    // In slices, so that a cancelled call stops waiting.
    const absl::Time until = answering ? std::min(deadline, absl::Now() + absl::Seconds(1)) : idle_until;
    absl::Status st = core_.admission().ResizeWaiting(receipt, 0, bytes, until);
    if (st.ok() || !answering || absl::Now() >= deadline) return st;
    if (context->IsCancelled()) return absl::CancelledError("ScoreStream: the client cancelled the call");
  }
}

grpc::Status ScoringService::Received(grpc::ServerContext* context, const char* method, Receipt* receipt,
                                      size_t bytes) {
  if (receipt->empty()) return grpc::Status::OK;
  if (static_cast<int64_t>(bytes) > receipt->bytes())
    return Reply(context, absl::InvalidArgumentError(absl::StrCat(
                              method, ": the request has ", bytes, " bytes, more than the ", receipt->bytes(),
                              " its metadata ", kRequestBytesMetadataKey, " announced")));
  const absl::Status st = core_.admission().Resize(receipt, 0, static_cast<int64_t>(bytes));  // gives back
  return st.ok() ? grpc::Status::OK : Reply(context, st);
}

grpc::Status ScoringService::ServeScoreStream(
    grpc::ServerContext* context, grpc::ServerReaderWriterInterface<v1::ScoreResponse, v1::ScoreRequest>* stream) {
  LOGPROB_RETURN_IF_ERROR(Authorize(context, "ScoreStream"));
  // gRPC fills ServerContext::client_metadata()'s map on its first call,
  // unsynchronised: fill it here, before the messages' threads read it
  // concurrently (the shared-memory session key), or one of them may find
  // it empty ("shared-memory calls need the metadata ...").
  (void)context->client_metadata();
  // Every message's bytes count in the admission from before it is read:
  // the stream's announced largest message, else max_request_bytes.
  const absl::StatusOr<std::optional<int64_t>> announced = AnnouncedBytes(*context);
  if (!announced.ok()) return Refused(context, "ScoreStream", Reply(context, announced.status()));
  const int64_t reserve = announced->value_or(core_.config().max_request_bytes);
  // Messages are scored concurrently (so they can share worker batches),
  // up to kStreamInFlight at a time; a writer thread answers in order.
  // Each answer holds its message's receipt until it is written.
  struct Pending {
    std::future<v1::ScoreResponse> answer;
    std::shared_ptr<Receipt> receipt;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Pending> answers;  // in request order
  int unanswered = 0;           // read, not yet written (or failed to)
  bool reading_done = false, write_failed = false;
  std::thread writer([&] {
    for (;;) {
      Pending next;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !answers.empty() || reading_done; });
        if (answers.empty()) return;
        next = std::move(answers.front());
        answers.pop_front();
      }
      const v1::ScoreResponse resp = next.answer.get();
      // Write without the lock, so the reader can queue more messages
      // meanwhile (only this thread sets write_failed).
      const bool written = !write_failed && stream->Write(resp);
      std::lock_guard<std::mutex> lock(mu);
      if (!written) write_failed = true;
      --unanswered;
      next.receipt.reset();  // the message's bytes leave the admission once answered
      cv.notify_all();
    }
  });
  grpc::Status ended;  // why the reads stopped early, if the server stopped them
  for (;;) {
    bool answering = false;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return unanswered < kStreamInFlight || write_failed; });
      if (write_failed) break;
      answering = unanswered > 0;
    }
    auto receipt = std::make_shared<Receipt>();
    if (absl::Status st = ReserveStreamed(context, reserve, answering, receipt.get()); !st.ok()) {
      ended = Refused(context, "ScoreStream", Reply(context, st));
      break;
    }
    auto req = std::make_shared<v1::ScoreRequest>();
    if (!stream->Read(req.get())) break;
    if (grpc::Status st = Received(context, "ScoreStream", receipt.get(), req->ByteSizeLong()); !st.ok()) {
      ended = Refused(context, "ScoreStream", st);
      break;
    }
    std::lock_guard<std::mutex> lock(mu);
    ++unanswered;
    answers.push_back(
        Pending{std::async(std::launch::async,
                           [this, req, context, receipt] { return AnswerStreamed(*req, context, receipt.get()); }),
                receipt});
    cv.notify_all();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    reading_done = true;
    cv.notify_all();
  }
  writer.join();
  return ended;
}

v1::ScoreResponse ScoringService::AnswerStreamed(const v1::ScoreRequest& req, grpc::ServerContext* context,
                                                 Receipt* received) {
  auto r = Observe("ScoreStream", req, [&](RequestStats* stats) { return ScoreOne(req, stats, context, received); });
  if (r.ok()) return *std::move(r);
  v1::ScoreResponse resp;
  resp.set_id(req.id());
  resp.set_status_code(static_cast<int>(r.status().code()));
  resp.set_status_message(ToGrpc(r.status()).error_message());  // escaped and cut as a call's status
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
  LOGPROB_RETURN_IF_ERROR(inputs_.SharedMemoryEnabled());
  return SharedMemoryOwner(*context);
}

namespace {

/// Logs and counts (logprob_requests_total) one shared-memory or lm_head update call and returns its
/// gRPC status, its reason (if any) added to `ctx`'s trailing metadata (ReplyWithReason; once per call).
grpc::Status Logged(grpc::ServerContext* ctx, Metrics* metrics, const char* method, const std::string& what,
                    const absl::Status& st) {
  if (metrics) metrics->ObserveRequest(method, absl::StatusCodeToString(st.code()), 0, 0);
  // `what` and the message hold names a client gave: escaped (no forged lines) and cut.
  LogLine() << "request method=" << method << " " << Printable(what, 512)
            << " status=" << absl::StatusCodeToString(st.code())
            << (st.ok() ? "" : " message=\"" + Printable(st.message(), 1024) + "\"");
  return ReplyWithReason(ctx, st);
}

}  // namespace

grpc::Status ScoringService::RegisterSharedMemory(grpc::ServerContext* context,
                                                  const v1::RegisterSharedMemoryRequest* req,
                                                  v1::RegisterSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "RegisterSharedMemory");
  const std::string what =
      absl::StrCat("region=", req->name(), " shm_name=", req->shm_name(), " byte_size=", req->byte_size());
  if (!session.ok()) return Logged(context, metrics_, "RegisterSharedMemory", what, session.status());
  auto r = inputs_.RegisterSharedMemory(*session, req->name(), req->shm_name(), req->byte_size());
  const absl::Status st = r.status();
  if (r.ok()) {
    resp->set_challenge(r->challenge);
    resp->set_proof_offset(r->proof_offset);
  }
  return Logged(context, metrics_, "RegisterSharedMemory", what, st);
}

grpc::Status ScoringService::ConfirmSharedMemory(grpc::ServerContext* context,
                                                 const v1::ConfirmSharedMemoryRequest* req,
                                                 v1::ConfirmSharedMemoryResponse*) {
  auto session = ShmSession(context, "ConfirmSharedMemory");
  const std::string what = absl::StrCat("region=", req->name());
  if (!session.ok()) return Logged(context, metrics_, "ConfirmSharedMemory", what, session.status());
  return Logged(context, metrics_, "ConfirmSharedMemory", what, inputs_.ConfirmSharedMemory(*session, req->name()));
}

grpc::Status ScoringService::UnregisterSharedMemory(grpc::ServerContext* context,
                                                    const v1::UnregisterSharedMemoryRequest* req,
                                                    v1::UnregisterSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "UnregisterSharedMemory");
  const std::string what = absl::StrCat("region=", req->name());
  if (!session.ok()) return Logged(context, metrics_, "UnregisterSharedMemory", what, session.status());
  auto n = inputs_.UnregisterSharedMemory(*session, req->name());
  if (n.ok()) resp->set_unregistered(*n);
  return Logged(context, metrics_, "UnregisterSharedMemory", what, n.status());
}

grpc::Status ScoringService::ListSharedMemory(grpc::ServerContext* context, const v1::ListSharedMemoryRequest*,
                                              v1::ListSharedMemoryResponse* resp) {
  auto session = ShmSession(context, "ListSharedMemory");
  if (!session.ok()) return Reply(context, session.status());
  auto regions = inputs_.ListSharedMemory(*session);
  if (!regions.ok()) return Reply(context, regions.status());
  for (const auto& [r, confirmed] : *regions) {
    v1::SharedMemoryRegionStatus* out = resp->add_regions();
    out->set_name(r->name());
    out->set_shm_name(r->shm_name());
    out->set_byte_size(r->byte_size());
    out->set_confirmed(confirmed);
  }
  return grpc::Status::OK;
}

absl::StatusOr<LmHeadUpdates*> ScoringService::Updates(grpc::ServerContext* context, const char* method) {
  if (grpc::Status st = Authorize(context, method, Right::kUpdate); !st.ok()) return FromGrpc(st);
  if (!updates_ || !updates_->options().allowed)
    return WithReason(
        absl::FailedPreconditionError("lm_head updates are off on this server (start it with --allow-lm-head-updates)"),
        v1::LM_HEAD_UPDATES_DISABLED);
  return updates_;
}

template <class Resp>
grpc::Status ScoringService::UpdateCall(grpc::ServerContext* context, const char* method, const std::string& what,
                                        const std::function<absl::StatusOr<Resp>(LmHeadUpdates&)>& call, Resp* resp) {
  absl::StatusOr<LmHeadUpdates*> updates = Updates(context, method);
  absl::StatusOr<Resp> r = updates.ok() ? call(**updates) : absl::StatusOr<Resp>(updates.status());
  if (r.ok()) *resp = *r;
  return Logged(context, metrics_, method, what, r.status());
}

grpc::Status ScoringService::BeginLmHeadUpdate(grpc::ServerContext* context, const v1::BeginLmHeadUpdateRequest* req,
                                               v1::LmHeadUpdate* resp) {
  return UpdateCall<v1::LmHeadUpdate>(
      context, "BeginLmHeadUpdate", absl::StrCat("head=", req->head(), " version=", req->version()),
      [req, context](LmHeadUpdates& u) { return u.Begin(*req, absl::FromChrono(context->deadline())); }, resp);
}

grpc::Status ScoringService::CommitLmHeadUpdate(grpc::ServerContext* context, const v1::LmHeadUpdateRef* req,
                                                v1::LmHeadInfo* resp) {
  return UpdateCall<v1::LmHeadInfo>(
      context, "CommitLmHeadUpdate", absl::StrCat("update=", UpdateTag(req->update_id())),
      [req](LmHeadUpdates& u) { return u.Commit(req->update_id()); }, resp);
}

grpc::Status ScoringService::AbortLmHeadUpdate(grpc::ServerContext* context, const v1::LmHeadUpdateRef* req,
                                               v1::LmHeadUpdate* resp) {
  return UpdateCall<v1::LmHeadUpdate>(
      context, "AbortLmHeadUpdate", absl::StrCat("update=", UpdateTag(req->update_id())),
      [req](LmHeadUpdates& u) { return u.Abort(req->update_id()); }, resp);
}

grpc::Status ScoringService::ReadLmHeadRows(grpc::ServerContext* context, const v1::ReadLmHeadRowsRequest* req,
                                            grpc::ServerWriter<v1::LmHeadRowsChunk>* writer) {
  return ServeReadLmHeadRows(context, req, writer);
}

grpc::Status ScoringService::ServeReadLmHeadRows(grpc::ServerContext* context, const v1::ReadLmHeadRowsRequest* req,
                                                 grpc::internal::WriterInterface<v1::LmHeadRowsChunk>* writer) {
  constexpr char kMethod[] = "ReadLmHeadRows";
  absl::Status st = Updates(context, kMethod).status();
  if (st.ok() && core_.config().lm_heads == nullptr) st = absl::NotFoundError("this server holds no lm_head");
  if (st.ok())
    st = ReadLmHeadVersion(
        *core_.config().lm_heads, *req, chunked::kDefaultPieceBytes,
        [&](const v1::LmHeadRowsChunk& part) { return !context->IsCancelled() && writer->Write(part); });
  return Logged(context, metrics_, kMethod,
                absl::StrCat("head=", Printable(req->head(), 64), " version=", Printable(req->version(), 128),
                             " rows=", req->row_begin(), "..", req->row_end()),
                st);
}

grpc::Status ScoringService::ReadHeadGradients(grpc::ServerContext* context, const v1::ReadHeadGradientsRequest* req,
                                               grpc::ServerWriter<v1::HeadGradientsChunk>* writer) {
  return ServeReadHeadGradients(context, req, writer);
}

grpc::Status ScoringService::ServeReadHeadGradients(grpc::ServerContext* context,
                                                    const v1::ReadHeadGradientsRequest* req,
                                                    grpc::internal::WriterInterface<v1::HeadGradientsChunk>* writer) {
  constexpr char kMethod[] = "ReadHeadGradients";
  if (grpc::Status denied = Authorize(context, kMethod); !denied.ok()) return denied;
  const absl::Status st = core_.ReadHeadGradients(
      *req, [&](const v1::HeadGradientsChunk& piece) { return !context->IsCancelled() && writer->Write(piece); });
  return Logged(context, metrics_, kMethod,
                absl::StrCat("step=", Printable(req->gradient_step(), 128), " head=", Printable(req->head(), 64),
                             " rows=", req->row_begin(), "..", req->row_end()),
                st);
}

grpc::Status ScoringService::CloseHeadGradientStep(grpc::ServerContext* context,
                                                   const v1::CloseHeadGradientStepRequest* req,
                                                   v1::CloseHeadGradientStepResponse*) {
  constexpr char kMethod[] = "CloseHeadGradientStep";
  if (grpc::Status denied = Authorize(context, kMethod); !denied.ok()) return denied;
  return Logged(context, metrics_, kMethod, absl::StrCat("step=", Printable(req->gradient_step(), 128)),
                core_.CloseHeadGradientStep(*req));
}

grpc::Status ScoringService::Distill(grpc::ServerContext* context, const v1::DistillRequest* req,
                                     v1::DistillResponse* resp) {
  constexpr char kMethod[] = "Distill";
  if (grpc::Status denied = Authorize(context, kMethod); !denied.ok()) return denied;
  CallContext call;
  call.deadline = context->deadline();
  call.cancelled = [context] { return context->IsCancelled(); };
  int64_t rows = 0;
  absl::StatusOr<v1::DistillResponse> r = core_.Distill(*req, call, &rows);
  const absl::Status st = r.status();
  if (r.ok()) *resp = *std::move(r);
  return Logged(context, metrics_, kMethod,
                absl::StrCat("id=", Printable(req->id(), 128), " student=", Printable(req->student_head(), 64),
                             " teacher=", Printable(req->teacher_head(), 64), " rows=", rows, " beta=", req->beta()),
                st);
}

grpc::Status ScoringService::ServeLmHeadRows(
    grpc::ServerContext* context, grpc::ServerReaderWriter<v1::LmHeadUpdate, chunked::IncomingPart>* stream) {
  constexpr char kMethod[] = "PutLmHeadRows";
  v1::LmHeadRows rows;
  auto put = [&]() -> absl::StatusOr<v1::LmHeadUpdate> {
    LOGPROB_ASSIGN_OR_RETURN(LmHeadUpdates * updates, Updates(context, kMethod));
    chunked::IncomingPart in;
    {
      // A call that sends nothing holds a thread: capped, and cancelled
      // after --lm-head-update-timeout.
      LOGPROB_ASSIGN_OR_RETURN(const FirstPartWatch::Waiting waiting, first_parts_->Watch(context, kMethod));
      if (!stream->Read(&in))
        return context->IsCancelled()
                   ? absl::DeadlineExceededError(
                         "PutLmHeadRows sent no first part within --lm-head-update-timeout: cancelled")
                   : absl::InvalidArgumentError("PutLmHeadRows ended before its first part (the rows)");
    }
    LOGPROB_ASSIGN_OR_RETURN(chunked::ParsedPart first, chunked::ParsePart(in));
    if (first.is_piece() || !rows.ParseFromString(first.message()))
      return absl::InvalidArgumentError("the first part of PutLmHeadRows must carry LmHeadRows");
    // The protocol is LmHeadUpdates::Put's; this only says how bytes come:
    // in pieces after the message (written as they arrive), or referenced.
    LmHeadPutIo io;
    io.cancel = [context] { context->TryCancel(); };
    io.follow = [&](char* dst, const std::function<void(int64_t)>& progressed) -> absl::Status {
      // The bytes the shape announces beyond the inline ones, in pieces.
      google::protobuf::RepeatedPtrField<v1::Tensor> tensors;
      *tensors.Add() = rows.rows();
      LOGPROB_ASSIGN_OR_RETURN(chunked::TensorAssembler assembly, chunked::TensorAssembler::Plan(&tensors, "rows"));
      if (assembly.pending_bytes() > core_.config().max_request_bytes)
        return absl::ResourceExhaustedError(absl::StrCat(
            "PutLmHeadRows announces ", assembly.pending_bytes(), " bytes, over the server's max_request_bytes ",
            core_.config().max_request_bytes, "; send fewer rows per call"));
      LOGPROB_RETURN_IF_ERROR(assembly.AssembleInto(dst));
      // Pieces come in order after the inline bytes: before each read, dst
      // holds the inline bytes and every piece so far.
      const int64_t inline_bytes = static_cast<int64_t>(rows.rows().data().size());
      return chunked::ReadChunkedPieces(
          [stream, &progressed, &assembly, inline_bytes](chunked::IncomingPart* p) {
            progressed(inline_bytes + assembly.received_bytes());
            return stream->Read(p);
          },
          [context] { return CallEnded(context); }, assembly);
    };
    io.caller.session = [context] { return SharedMemoryOwner(*context); };
    io.caller.peer = context->peer();
    return updates->Put(rows, io);
  };
  absl::StatusOr<v1::LmHeadUpdate> r = put();
  const grpc::Status replied =
      Logged(context, metrics_, kMethod,
             absl::StrCat("update=", UpdateTag(rows.update_id()), " row_begin=", rows.row_begin(),
                          " rows=", rows.rows().shape_size() > 0 ? rows.rows().shape(0) : 0),
             r.status());
  if (!r.ok()) return replied;
  if (!stream->Write(*r)) return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
  return grpc::Status::OK;
}

}  // namespace logprob
