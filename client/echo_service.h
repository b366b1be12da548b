// The raw-transfer baseline of `logprob-client bench`: an in-process gRPC
// server on loopback that speaks logprob.v1.LogprobService but does no
// scoring, so sending it the bench's request measures what gRPC transfer
// alone costs for the same bytes.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/buffer_pool.h"
#include "common/chunked_method.h"
#include "grpcpp/server.h"
#include "grpcpp/support/sync_stream.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob::client {

/// A LogprobService whose Score answers every request with a copy of a
/// fixed reply (its id replaced by the request's). gRPC parses the request
/// into a ScoreRequest before Score runs, exactly as for logprob-server's
/// front-end, and serializes the reply, so a call moves the same request
/// and reply bytes through the same code as a real call, minus the
/// scoring. ScoreChunked likewise: it reads and assembles the parts as
/// logprob-server does (chunked::ReadChunkedRequest into pooled buffers) and answers the reply in parts
/// (chunked::WriteChunkedResponse). ScoreStream and GetServerInfo are
/// UNIMPLEMENTED.
class EchoScoringService final : public v1::LogprobService::Service {
 public:
  explicit EchoScoringService(v1::ScoreResponse reply);
  grpc::Status Score(grpc::ServerContext* context, const v1::ScoreRequest* request,
                     v1::ScoreResponse* response) override;
  /// ScoreChunked (installed with chunked::NewChunkedHandler).
  grpc::Status ServeChunked(grpc::ServerContext* context, chunked::ServerStream* stream);

 private:
  const v1::ScoreResponse reply_;
  BufferPool buffers_{int64_t{2} << 30};  // ScoreChunked request tensors, as logprob-server
};

/// An EchoScoringService serving plaintext on 127.0.0.1 (a free port) with
/// logprob-server's message limits: receive `max_request_bytes`, send
/// INT_MAX. Stops (cancelling calls in flight) when destroyed.
class EchoServer {
 public:
  /// Starts the server. UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<EchoServer>> Start(v1::ScoreResponse reply, int max_request_bytes);
  ~EchoServer();

  /// "127.0.0.1:PORT".
  const std::string& address() const { return address_; }

 private:
  explicit EchoServer(v1::ScoreResponse reply) : service_(std::move(reply)) {}

  EchoScoringService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace logprob::client
