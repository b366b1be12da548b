// The public LogprobService: validate -> plan -> dispatch -> gather -> reply.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/buffer_pool.h"
#include "common/chunk_codec.h"
#include "common/chunked_method.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/sync_stream.h"
#include "logprob/v1/logprob.grpc.pb.h"
#include "server/admission.h"
#include "server/auth.h"
#include "server/batcher.h"
#include "server/client_regions.h"
#include "server/cuda_ipc_inputs.h"
#include "server/metrics.h"
#include "server/planner.h"
#include "server/score_job.h"
#include "server/worker_pool.h"

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
  LmHeadShape lm_head;        // zeros: no hidden-states scoring
  std::string lm_head_dtype;  // safetensors name, e.g. "BF16"
  std::string lm_head_path;   // file holding the tensor
  std::string lm_head_tensor;
  int64_t hidden_chunk_tokens = 0;
  std::string lm_head_precision;  // "bf16" | "tf32" | "fp32" (auto resolved); empty without an lm_head
  /// Shared-memory inputs from same-host clients (RegisterSharedMemory,
  /// Tensor.shared_memory; server/client_regions.h): caps and idle expiry.
  bool shared_memory_inputs = true;
  ClientRegions::Options shared_memory_regions;
  /// CUDA IPC inputs (Tensor.cuda_ipc; server/cuda_ipc_inputs.h): accepted
  /// when this is set, `backend` is "cuda", the pool's workers run on this
  /// host and there is one of them or `comm` is "nccl".
  bool cuda_ipc_inputs = true;
  /// When set (not owned; outlives the service), every call must carry its
  /// bearer token, else UNAUTHENTICATED.
  const BearerTokenAuth* auth = nullptr;
};

/// gRPC service implementation. Errors: UNAUTHENTICATED without the
/// bearer token when config.auth is set (every method); INVALID_ARGUMENT /
/// FAILED_PRECONDITION from validation (see BuildScoreJob), UNAVAILABLE
/// when a worker fails. ScoreChunked is served by ServeChunked, whose parts
/// are parsed by chunked::ParsePart, not protobuf.
class ScoringService final : public v1::LogprobService::Service {
 public:
  ScoringService(WorkerPool& pool, ServiceConfig config, Metrics* metrics);

  grpc::Status Score(grpc::ServerContext*, const v1::ScoreRequest*, v1::ScoreResponse*) override;
  /// Scores each message like Score, up to kStreamInFlight messages of a
  /// stream at a time (so they can share worker batches), and answers in
  /// message order; a failed message gets a response carrying its status.
  grpc::Status ScoreStream(grpc::ServerContext*,
                           grpc::ServerReaderWriter<v1::ScoreResponse, v1::ScoreRequest>*) override;
  /// Messages of one ScoreStream scored concurrently.
  static constexpr int kStreamInFlight = 16;
  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::ServerInfoRequest*, v1::ServerInfo*) override;
  /// Shared-memory regions of the caller's session (server/shm_session.h):
  /// FAILED_PRECONDITION when the server runs with
  /// --shared-memory-inputs=false; else ClientRegions' errors.
  grpc::Status RegisterSharedMemory(grpc::ServerContext*, const v1::RegisterSharedMemoryRequest*,
                                    v1::RegisterSharedMemoryResponse*) override;
  grpc::Status UnregisterSharedMemory(grpc::ServerContext*, const v1::UnregisterSharedMemoryRequest*,
                                      v1::UnregisterSharedMemoryResponse*) override;
  grpc::Status ListSharedMemory(grpc::ServerContext*, const v1::ListSharedMemoryRequest*,
                                v1::ListSharedMemoryResponse*) override;

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

  /// What one request's log line reports besides its status.
  struct RequestStats {
    int64_t rows = 0;            // token positions scored
    double queue_seconds = 0;    // waiting to be batched
    int batch_requests = 0;      // requests in its worker batch
    double receive_seconds = 0;  // ScoreChunked: first part to the last piece
  };

  /// Scores one request (the body of Score and of each ScoreStream
  /// message): validate, admit, batch (server/batcher.h), reply. Fills
  /// *stats if given. `ctx` (may be null) bounds the work by its deadline
  /// and cancellation, and names the session whose shared-memory regions
  /// the request's tensors may reference (none without it) and the peer a
  /// CUDA IPC input comes from (FindCudaIpcInput, CheckCudaIpcAvailable:
  /// INVALID_ARGUMENT for a malformed reference, FAILED_PRECONDITION when
  /// the feature cannot serve this call).
  absl::StatusOr<v1::ScoreResponse> ScoreOne(const v1::ScoreRequest& req, RequestStats* stats = nullptr,
                                             grpc::ServerContext* ctx = nullptr);

 private:
  /// OK, or (config_.auth set and the call lacks the token) UNAUTHENTICATED,
  /// which is counted in the metrics and logged with the peer address.
  grpc::Status Authorize(const grpc::ServerContext* context, const char* method);
  /// The caller's shared-memory session (SharedMemoryOwner), after
  /// Authorize; FAILED_PRECONDITION when shared-memory inputs are off.
  absl::StatusOr<std::string> ShmSession(grpc::ServerContext* context, const char* method);
  /// One ScoreStream message's response: ScoreOne's, or its status as
  /// status_code / status_message.
  v1::ScoreResponse AnswerStreamed(const v1::ScoreRequest& req, grpc::ServerContext* context);
  /// Runs `fn` (which fills the request's stats), records the request's
  /// metrics under `method` and logs one line for it; `req` is read after
  /// `fn` (its size and id).
  absl::StatusOr<v1::ScoreResponse> Observe(const char* method, const v1::ScoreRequest& req,
                                            const std::function<absl::StatusOr<v1::ScoreResponse>(RequestStats*)>& fn);
  /// Reads a ScoreChunked request into *req (its pieced tensors' data in
  /// buffers of assembly_buffers_, their indices in *pooled).
  absl::Status ReceiveChunked(grpc::ServerContext* context, chunked::ServerStream* stream, v1::ScoreRequest* req,
                              std::vector<int>* pooled);

  WorkerPool& pool_;
  ServiceConfig config_;
  Metrics* metrics_;
  Admission admission_;
  PayloadPool payload_pool_;
  Batcher batcher_;
  BufferPool assembly_buffers_;             // ScoreChunked request tensors
  std::unique_ptr<ClientRegions> regions_;  // null: shared-memory inputs off
  std::string host_id_;
  CudaIpcAvailability cuda_ipc_;
  std::atomic<uint64_t> next_job_id_{1};
};

}  // namespace logprob
