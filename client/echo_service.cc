#include "client/echo_service.h"

#include <chrono>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/chunk_assembler.h"
#include "common/exclusive_port.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace logprob::client {

grpc::Status EchoScoringService::Score(grpc::ServerContext*, const v1::ScoreRequest* request,
                                       v1::ScoreResponse* response) {
  *response = reply_;
  response->set_id(request->id());
  return grpc::Status::OK;
}

EchoScoringService::EchoScoringService(v1::ScoreResponse reply) : reply_(std::move(reply)) {
  MarkMethodStreamed(chunked::ScoreChunkedMethodIndex(), chunked::NewChunkedHandler(this));
}

grpc::Status EchoScoringService::ServeChunked(grpc::ServerContext* context, chunked::ServerStream* stream) {
  v1::ScoreRequest request;
  std::vector<int> pieced;
  const absl::Status st = chunked::ReadChunkedRequest(
      [stream](chunked::IncomingPart* in) { return stream->Read(in); }, [context] { return context->IsCancelled(); },
      [](const v1::ScoreRequest&, int64_t) { return absl::OkStatus(); },
      [this](size_t n) { return buffers_.Acquire(n); }, &request, &pieced);
  for (int i : pieced) buffers_.Release(std::move(*request.mutable_inputs(i)->mutable_data()));
  if (!st.ok()) return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
  v1::ScoreResponse response = reply_;
  response.set_id(request.id());
  chunked::WriteChunkedResponse([stream](const chunked::OutgoingPart& p) { return stream->Write(p); },
                                std::move(response), chunked::kDefaultPieceBytes, 64 << 10);
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<EchoServer>> EchoServer::Start(v1::ScoreResponse reply, int max_request_bytes) {
  std::unique_ptr<EchoServer> echo(new EchoServer(std::move(reply)));
  grpc::ServerBuilder builder;
  int port = 0;
  ExclusivePorts(builder);
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(max_request_bytes);
  builder.SetMaxSendMessageSize(INT_MAX);
  builder.RegisterService(&echo->service_);
  echo->server_ = builder.BuildAndStart();
  if (!echo->server_ || port == 0) return absl::UnavailableError("echo server: cannot listen on 127.0.0.1");
  echo->address_ = absl::StrCat("127.0.0.1:", port);
  return echo;
}

EchoServer::~EchoServer() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
}

}  // namespace logprob::client
