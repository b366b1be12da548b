#include "client/chunked_call.h"

#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/commands.h"
#include "common/chunk_assembler.h"
#include "common/grpc_status.h"
#include "common/input_kind.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"

namespace logprob::client {
namespace {

constexpr char kMethodName[] = "/logprob.v1.LogprobService/ScoreChunked";
// The most output bytes an answer may announce: a server's answer beyond
// this (a broken or hostile one) is an error, not an allocation.
constexpr int64_t kMaxResponseBytes = int64_t{16} << 30;

using Stream = grpc::ClientReaderWriter<chunked::OutgoingPart, chunked::IncomingPart>;

absl::Status BadAnswer(const absl::Status& s) {
  return absl::InternalError(absl::StrCat("malformed ScoreChunked answer: ", s.message()));
}

/// Reads the answer parts of `stream` into a response (chunked::ReadChunkedResponse).
absl::StatusOr<v1::ScoreResponse> ReadAnswer(Stream* stream) {
  absl::StatusOr<v1::ScoreResponse> resp =
      chunked::ReadChunkedResponse([stream](chunked::IncomingPart* in) { return stream->Read(in); }, kMaxResponseBytes);
  if (resp.ok()) return resp;
  if (absl::IsNotFound(resp.status())) return absl::InternalError("no answer");  // the call's status tells why
  return BadAnswer(resp.status());
}

}  // namespace

absl::StatusOr<v1::ScoreResponse> ScoreChunked(const std::shared_ptr<grpc::Channel>& channel,
                                               const v1::ScoreRequest& request, int64_t piece_bytes,
                                               double timeout_seconds, int64_t inline_bytes) {
  // The first part: the request without the bytes that follow in pieces.
  const std::vector<int> pieced = chunked::PiecedTensors(request.inputs(), inline_bytes);
  v1::ScoreRequest header;
  header.set_id(request.id());
  *header.mutable_options() = request.options();
  header.set_head(request.head());
  header.set_head_version(request.head_version());
  std::vector<std::string_view> data;
  size_t next = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const v1::Tensor& t = request.inputs(i);
    v1::Tensor* h = header.add_inputs();
    h->set_name(t.name());
    h->set_dtype(t.dtype());
    *h->mutable_shape() = t.shape();
    if (KindOf(t) != InputKind::kBytes) {
      *h = t;  // a reference (shared memory, CUDA IPC) stands for the bytes
    } else if (next < pieced.size() && pieced[next] == i) {
      data.push_back(t.data());
      ++next;
    } else {
      h->set_data(t.data());
    }
  }

  return ScoreChunkedViews(channel, header, pieced, data, piece_bytes, timeout_seconds);
}

absl::StatusOr<v1::ScoreResponse> ScoreChunkedViews(const std::shared_ptr<grpc::Channel>& channel,
                                                    const v1::ScoreRequest& header, const std::vector<int>& pieced,
                                                    const std::vector<std::string_view>& data, int64_t piece_bytes,
                                                    double timeout_seconds) {
  v1::ScoreRequestPart first;
  *first.mutable_request() = header;  // small: the pieced tensors' data is empty
  grpc::ClientContext context;
  SetTimeout(&context, timeout_seconds);
  const grpc::internal::RpcMethod method(kMethodName, grpc::internal::RpcMethod::BIDI_STREAMING, channel);
  std::unique_ptr<Stream> stream(
      grpc::internal::ClientReaderWriterFactory<chunked::OutgoingPart, chunked::IncomingPart>::Create(
          channel.get(), method, &context));
  chunked::OutgoingPart part;
  part.message = &first;
  // A failed write means the server ended the call: Finish says why.
  if (stream->Write(part) && chunked::WritePieces([&](const chunked::OutgoingPart& p) { return stream->Write(p); },
                                                  pieced, data, piece_bytes)) {
    stream->WritesDone();
  }
  absl::StatusOr<v1::ScoreResponse> answer = ReadAnswer(stream.get());
  // Drain what the server may still send, then take the call's status.
  chunked::IncomingPart rest;
  while (stream->Read(&rest)) {
  }
  const grpc::Status status = stream->Finish();
  if (!status.ok()) return FromGrpc(status);
  return answer;
}

}  // namespace logprob::client
