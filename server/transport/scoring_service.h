// The public LogprobService over gRPC: the transport adapter of the scoring
// core (server/core/scoring_core.h): authentication, sessions and peers from the
// call, streams and chunked parts, status mapping, per-request logs and
// metrics.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/buffer_pool.h"
#include "common/chunk_codec.h"
#include "common/chunked_method.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/sync_stream.h"
#include "logprob/v1/logprob.grpc.pb.h"
#include "server/core/scoring_core.h"
#include "server/heads/lm_head_updates.h"
#include "server/metrics/metrics.h"
#include "server/pool/worker_pool.h"
#include "server/transport/auth.h"
#include "server/transport/first_part_watch.h"

namespace logprob {

/// gRPC service implementation. Errors: UNAUTHENTICATED without the
/// bearer token when config.auth is set (every method), and for update
/// calls without config.update_auth's token (PERMISSION_DENIED with the
/// scoring token only: server/transport/auth.h AccessPolicy); ScoringCore's
/// errors, with a machine-readable reason (common/error_reason.h) in the
/// status details. Every other method's requests are parsed by the service
/// (common/parsed_requests.h): a malformed message is INVALID_ARGUMENT
/// naming the method. ScoreChunked and PutLmHeadRows are served through
/// the part codec, whose parts are parsed by chunked::ParsePart.
class ScoringService final : public v1::LogprobService::Service {
 public:
  /// What a unary call's request holds of the admission from before its
  /// body is read until it is answered (common/parsed_requests.h).
  using Receipt = Admission::Ticket;
  /// `inputs` (the app's; not owned) resolves requests' tensors and keeps
  /// the clients' shared-memory regions. `updates` (not owned; may be null:
  /// updates off) serves the lm_head update calls. `metrics` (may be null)
  /// observes the core (CoreObservers) and the calls.
  /// `access`: which bearer token grants which right (none: open).
  ScoringService(WorkerPool& pool, ServiceConfig config, InputResolver& inputs, Metrics* metrics,
                 LmHeadUpdates* updates = nullptr, AccessPolicy access = AccessPolicy(nullptr, nullptr));
  /// The core this adapter serves (tests, in-process callers).
  ScoringCore& core() { return core_; }

  grpc::Status Score(grpc::ServerContext*, const v1::ScoreRequest*, v1::ScoreResponse*) override;
  /// Score of a request whose bytes `received` holds in the admission
  /// (Reserve): admitted into it (the server's handler).
  grpc::Status ScoreReceived(grpc::ServerContext* context, const v1::ScoreRequest* req, v1::ScoreResponse* resp,
                             Receipt* received);
  /// Scores each message like Score, up to kStreamInFlight messages of a
  /// stream at a time (so they can share worker batches), and answers in
  /// message order; a failed message gets a response carrying its status.
  /// Each message's bytes are reserved in the admission before it is read
  /// (ReserveStreamed: the `logprob-request-bytes` metadata announces the
  /// stream's largest message, else max_request_bytes is held) and kept
  /// until its answer is written; a message over the announcement ends the
  /// stream INVALID_ARGUMENT, no room for an idle stream's next message
  /// RESOURCE_EXHAUSTED, after the answers of the messages read.
  grpc::Status ScoreStream(grpc::ServerContext*,
                           grpc::ServerReaderWriter<v1::ScoreResponse, v1::ScoreRequest>*) override;
  /// ScoreStream's body on any stream (the server's is a
  /// ParsingReaderWriter: common/parsed_requests.h).
  grpc::Status ServeScoreStream(grpc::ServerContext* context,
                                grpc::ServerReaderWriterInterface<v1::ScoreResponse, v1::ScoreRequest>* stream);
  /// Messages of one ScoreStream scored concurrently.
  static constexpr int kStreamInFlight = 16;
  /// PutLmHeadRows calls that may wait for their first part at once (each
  /// holds a thread); more are RESOURCE_EXHAUSTED.
  static constexpr int kPutsAwaitingFirstPart = 16;
  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::ServerInfoRequest*, v1::ServerInfo*) override;
  /// Shared-memory regions of the caller's session (server/transport/shm_session.h):
  /// FAILED_PRECONDITION when the server runs with
  /// --shared-memory-inputs=false; else ClientRegions' errors.
  grpc::Status RegisterSharedMemory(grpc::ServerContext*, const v1::RegisterSharedMemoryRequest*,
                                    v1::RegisterSharedMemoryResponse*) override;
  grpc::Status UnregisterSharedMemory(grpc::ServerContext*, const v1::UnregisterSharedMemoryRequest*,
                                      v1::UnregisterSharedMemoryResponse*) override;
  grpc::Status ListSharedMemory(grpc::ServerContext*, const v1::ListSharedMemoryRequest*,
                                v1::ListSharedMemoryResponse*) override;
  grpc::Status ConfirmSharedMemory(grpc::ServerContext*, const v1::ConfirmSharedMemoryRequest*,
                                   v1::ConfirmSharedMemoryResponse*) override;

  /// lm_head updates (server/heads/lm_head_updates.h): FAILED_PRECONDITION
  /// (reason LM_HEAD_UPDATES_DISABLED) when off; else its errors.
  grpc::Status BeginLmHeadUpdate(grpc::ServerContext*, const v1::BeginLmHeadUpdateRequest*, v1::LmHeadUpdate*) override;
  grpc::Status CommitLmHeadUpdate(grpc::ServerContext*, const v1::LmHeadUpdateRef*, v1::LmHeadInfo*) override;
  grpc::Status AbortLmHeadUpdate(grpc::ServerContext*, const v1::LmHeadUpdateRef*, v1::LmHeadUpdate*) override;
  /// A retained version's rows read back (server/heads/lm_head_reader.h), for a
  /// peer catching up: allowed where updates are (the same checks as
  /// Begin: token, FAILED_PRECONDITION when off); ReadLmHeadVersion's
  /// errors.
  grpc::Status ReadLmHeadRows(grpc::ServerContext*, const v1::ReadLmHeadRowsRequest*,
                              grpc::ServerWriter<v1::LmHeadRowsChunk>*) override;
  /// ReadLmHeadRows' body on any writer (the server's parses its request
  /// itself: common/parsed_requests.h).
  grpc::Status ServeReadLmHeadRows(grpc::ServerContext* context, const v1::ReadLmHeadRowsRequest* req,
                                   grpc::internal::WriterInterface<v1::LmHeadRowsChunk>* writer);
  /// A gradient step's lm_head sums in pieces, and its close
  /// (ScoringCore::ReadHeadGradients / CloseHeadGradientStep): the scoring
  /// token's right, like Score (the step's key is the capability).
  grpc::Status ReadHeadGradients(grpc::ServerContext*, const v1::ReadHeadGradientsRequest*,
                                 grpc::ServerWriter<v1::HeadGradientsChunk>*) override;
  grpc::Status ServeReadHeadGradients(grpc::ServerContext* context, const v1::ReadHeadGradientsRequest* req,
                                      grpc::internal::WriterInterface<v1::HeadGradientsChunk>* writer);
  grpc::Status CloseHeadGradientStep(grpc::ServerContext*, const v1::CloseHeadGradientStepRequest*,
                                     v1::CloseHeadGradientStepResponse*) override;
  /// Full-vocabulary distillation (ScoringCore::Distill): the scoring
  /// token's right, like Score.
  grpc::Status Distill(grpc::ServerContext*, const v1::DistillRequest*, v1::DistillResponse*) override;
  /// PutLmHeadRows, served through the part codec like ScoreChunked: the
  /// first part's LmHeadRows, then (inline bytes announced by shape) its
  /// pieces, assembled into a pooled buffer (at most max_request_bytes per
  /// call: RESOURCE_EXHAUSTED beyond), or its shared-memory reference or
  /// file; answered with one LmHeadUpdate.
  grpc::Status ServeLmHeadRows(grpc::ServerContext* context,
                               grpc::ServerReaderWriter<v1::LmHeadUpdate, chunked::IncomingPart>* stream);

  /// Before a unary request's body is read: a Score request reserves its
  /// bytes in the admission (--max-queue-bytes), the size its
  /// `logprob-request-bytes` metadata announces (common/request_bytes.h)
  /// or, unannounced, max_request_bytes; the queue without room for them is
  /// RESOURCE_EXHAUSTED (reason AT_CAPACITY) before a byte of the body is
  /// read, and a caller without the token UNAUTHENTICATED. INVALID_ARGUMENT
  /// for an announcement that is not a size or exceeds max_request_bytes.
  /// An unannounced call whose reservation does not fit waits for room up
  /// to kUnannouncedWait (the calls reading before it shrink theirs to
  /// their size once read). Other methods: OK, nothing reserved.
  grpc::Status Reserve(grpc::ServerContext* context, const char* method, Receipt* receipt);
  /// How long an unannounced Score waits for room for its reservation.
  static constexpr absl::Duration kUnannouncedWait = absl::Seconds(2);
  /// Once the request's `bytes` arrived: the reservation becomes their
  /// size; INVALID_ARGUMENT when they exceed the announced size.
  grpc::Status Received(grpc::ServerContext* context, const char* method, Receipt* receipt, size_t bytes);

  /// A call refused before its method ran (a malformed request message:
  /// common/parsed_requests.h): logged and counted under `method`;
  /// returns `st`.
  grpc::Status Refused(const grpc::ServerContext* context, const char* method, const grpc::Status& st);

  /// The server side of ScoreChunked (proto/logprob/v1/logprob.proto): reads
  /// the request part, checks the announced size against
  /// max_request_bytes (RESOURCE_EXHAUSTED) and holds it in admission while
  /// the pieces arrive, checks each piece and copies its bytes once into a
  /// pooled buffer (chunked::TensorAssembler; INVALID_ARGUMENT naming the
  /// tensor and offset), scores the assembled request like Score once the
  /// client half-closes (INVALID_ARGUMENT if bytes are missing; CANCELLED
  /// if the client cancelled), and answers in parts: the response, then
  /// pieces of kResponsePieceBytes for outputs when it is larger than that.
  grpc::Status ServeChunked(grpc::ServerContext* context, chunked::ServerStream* stream);
  /// Piece size of chunked answers.
  static constexpr int64_t kResponsePieceBytes = chunked::kDefaultPieceBytes;

  /// Scores one request (the body of Score and of each ScoreStream
  /// message) on the core, bounded by `ctx`'s deadline and cancellation,
  /// with its shared-memory session and peer (ScoringCore::Score), admitted
  /// into `received` when given (CallContext::received).
  absl::StatusOr<v1::ScoreResponse> ScoreOne(const v1::ScoreRequest& req, RequestStats* stats, grpc::ServerContext* ctx,
                                             Receipt* received = nullptr);

 private:
  /// The gRPC status of `st`, its reason (ReasonOf) sent as the trailing
  /// metadata kReasonMetadataKey of the call.
  static grpc::Status Reply(grpc::ServerContext* ctx, const absl::Status& st);
  /// OK, or (the call lacks a token granting `right`: AccessPolicy)
  /// UNAUTHENTICATED or PERMISSION_DENIED, which is counted in the metrics
  /// and logged with the peer address.
  grpc::Status Authorize(const grpc::ServerContext* context, const char* method, Right right = Right::kScore);
  /// The caller's shared-memory session (SharedMemoryOwner), after
  /// Authorize; FAILED_PRECONDITION when shared-memory inputs are off.
  absl::StatusOr<std::string> ShmSession(grpc::ServerContext* context, const char* method);
  /// One ScoreStream message's response: ScoreOne's (admitted into
  /// `received`, the message's reservation), or its status as
  /// status_code / status_message.
  v1::ScoreResponse AnswerStreamed(const v1::ScoreRequest& req, grpc::ServerContext* context, Receipt* received);
  /// The size the call's `logprob-request-bytes` metadata announces
  /// (common/request_bytes.h; a ScoreStream's: its largest message), or
  /// nullopt without one. INVALID_ARGUMENT for a value that is not a size,
  /// RESOURCE_EXHAUSTED for one over max_request_bytes.
  absl::StatusOr<std::optional<int64_t>> AnnouncedBytes(const grpc::ServerContext& context) const;
  /// Before a ScoreStream message is read: `bytes` reserved in *receipt.
  /// No room: while the stream has answers to write (`answering`: they
  /// make room once written) it waits up to the call's deadline
  /// (backpressure; CANCELLED when the client cancels); an idle stream
  /// waits up to kUnannouncedWait, then RESOURCE_EXHAUSTED (AT_CAPACITY).
  absl::Status ReserveStreamed(grpc::ServerContext* context, int64_t bytes, bool answering, Receipt* receipt);
  /// Runs `fn` (which fills the request's stats), records the request's
  /// metrics under `method` and logs one line for it; `req` is read after
  /// `fn` (its size and id).
  absl::StatusOr<v1::ScoreResponse> Observe(const char* method, const v1::ScoreRequest& req,
                                            const std::function<absl::StatusOr<v1::ScoreResponse>(RequestStats*)>& fn);
  /// Reads a ScoreChunked request into *req (its pieced tensors' data in
  /// buffers of assembly_buffers_, their indices in *pooled).
  /// Its announced bytes are held in *received from the request part on.
  absl::Status ReceiveChunked(grpc::ServerContext* context, chunked::ServerStream* stream, v1::ScoreRequest* req,
                              std::vector<int>* pooled, Receipt* received);

  /// The updates, or FAILED_PRECONDITION when off (after Authorize).
  absl::StatusOr<LmHeadUpdates*> Updates(grpc::ServerContext* context, const char* method);
  /// One unary update call: `call` on the updates, logged and counted
  /// under `method` with `what`, its result in *resp.
  template <class Resp>
  grpc::Status UpdateCall(grpc::ServerContext* context, const char* method, const std::string& what,
                          const std::function<absl::StatusOr<Resp>(LmHeadUpdates&)>& call, Resp* resp);

  InputResolver& inputs_;
  ScoringCore core_;
  LmHeadUpdates* const updates_;
  /// PutLmHeadRows calls before their first part: at most
  /// kPutsAwaitingFirstPart at once, each for --lm-head-update-timeout
  /// (null without updates).
  const std::unique_ptr<FirstPartWatch> first_parts_;
  const AccessPolicy access_;  // which token grants which right
  Metrics* const metrics_;
  BufferPool assembly_buffers_;  // ScoreChunked request tensors
  // logprob_pooled_bytes of the pools above; destroyed first.
  std::vector<std::unique_ptr<MemoryMetrics::PoolRegistration>> pool_gauges_;
};

}  // namespace logprob
