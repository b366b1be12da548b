// ScoringService::ScoreChunked and its registration (ChunkedScoreMethod).
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/chunk_assembler.h"
#include "common/grpc_status.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/method_handler.h"
#include "server/scoring_service.h"

namespace logprob {

namespace {

constexpr char kMethod[] = "ScoreChunked";
/// Output tensors up to this size travel inside the first answer part.
constexpr int64_t kInlineBytes = 64 << 10;

using Stream = grpc::ServerReaderWriter<chunked::OutgoingPart, chunked::IncomingPart>;

/// Writes `resp` as ScoreResponseParts: whole when it fits in one piece,
/// else without the data of its large outputs, which follow in pieces.
bool WriteAnswer(Stream* stream, v1::ScoreResponse resp) {
  std::vector<int> pieced;
  if (static_cast<int64_t>(resp.ByteSizeLong()) > ScoringService::kResponsePieceBytes)
    pieced = chunked::PiecedTensors(resp.outputs(), kInlineBytes);
  std::vector<std::string> data(pieced.size());
  for (size_t k = 0; k < pieced.size(); ++k) data[k].swap(*resp.mutable_outputs(pieced[k])->mutable_data());
  v1::ScoreResponsePart first;
  *first.mutable_response() = std::move(resp);
  chunked::OutgoingPart part;
  part.message = &first;
  if (!stream->Write(part)) return false;
  const std::vector<std::string_view> views(data.begin(), data.end());
  return chunked::WritePieces([stream](const chunked::OutgoingPart& p) { return stream->Write(p); }, pieced, views,
                              ScoringService::kResponsePieceBytes);
}

}  // namespace

absl::Status ScoringService::ReceiveChunked(grpc::ServerContext* context, Stream* stream, v1::ScoreRequest* req,
                                            std::vector<int>* pooled) {
  chunked::IncomingPart in;
  if (!stream->Read(&in)) {
    if (context->IsCancelled()) return absl::CancelledError("the client cancelled the chunked request before its first part");
    return absl::InvalidArgumentError("the chunked request ended before its first part (the request)");
  }
  absl::StatusOr<chunked::ParsedPart> first = chunked::ParsePart(in);
  if (!first.ok()) return first.status();
  if (first->is_piece())
    return absl::InvalidArgumentError("the first part of a chunked request must carry the request, not a piece");
  if (!req->ParseFromString(first->message()))
    return absl::InvalidArgumentError("the first part's request cannot be parsed as a ScoreRequest");
  absl::StatusOr<chunked::TensorAssembler> assembly = chunked::TensorAssembler::Plan(req->mutable_inputs(), "inputs");
  if (!assembly.ok()) return assembly.status();
  const int64_t total = static_cast<int64_t>(req->ByteSizeLong()) + assembly->pending_bytes();
  if (total > config_.max_request_bytes)
    return absl::ResourceExhaustedError(absl::StrCat("chunked request ", req->id(), " announces ", total, " bytes (",
                                                     assembly->pending_bytes(),
                                                     " in pieces), over the server's max_request_bytes ",
                                                     config_.max_request_bytes));
  // The bytes count as admitted work while they arrive (backpressure);
  // ScoreOne admits the assembled request again once this ticket is gone.
  absl::StatusOr<Admission::Ticket> ticket = admission_.Admit(0, total);
  if (!ticket.ok()) return ticket.status();
  assembly->AllocateBuffers([this](size_t n) { return assembly_buffers_.Acquire(n); });
  while (stream->Read(&in)) {
    absl::StatusOr<chunked::ParsedPart> part = chunked::ParsePart(in);
    if (!part.ok())
      return absl::InvalidArgumentError(absl::StrCat(part.status().message(), " (at ", assembly->Position(), ")"));
    if (!part->is_piece())
      return absl::InvalidArgumentError(absl::StrCat("a second request part arrived at ", assembly->Position(),
                                                     "; only the first part carries the request"));
    if (absl::Status st = assembly->Add(*part); !st.ok()) return st;
  }
  if (context->IsCancelled())
    return absl::CancelledError(absl::StrCat("the client cancelled the chunked request at ", assembly->Position()));
  if (absl::Status st = assembly->Finish(); !st.ok()) return st;
  *pooled = assembly->pending();
  return absl::OkStatus();
}

grpc::Status ScoringService::ScoreChunked(grpc::ServerContext* context, Stream* stream) {
  if (grpc::Status st = Authorize(context, kMethod); !st.ok()) return st;
  v1::ScoreRequest req;
  std::vector<int> pooled;
  absl::StatusOr<v1::ScoreResponse> r = Observe(kMethod, req, [&](RequestStats* stats) -> absl::StatusOr<v1::ScoreResponse> {
    if (absl::Status st = ReceiveChunked(context, stream, &req, &pooled); !st.ok()) return st;
    return ScoreOne(req, stats, context);
  });
  for (int i : pooled) assembly_buffers_.Release(std::move(*req.mutable_inputs(i)->mutable_data()));
  if (!r.ok()) return ToGrpc(r.status());
  if (!WriteAnswer(stream, *std::move(r)))
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away before the answer was sent");
  return grpc::Status::OK;
}

ChunkedScoreMethod::ChunkedScoreMethod(ScoringService* service) {
  AddMethod(new grpc::internal::RpcServiceMethod(
      "/logprob.v1.LogprobService/ScoreChunked", grpc::internal::RpcMethod::BIDI_STREAMING,
      new grpc::internal::BidiStreamingHandler<ScoringService, chunked::IncomingPart, chunked::OutgoingPart>(
          [](ScoringService* s, grpc::ServerContext* context, Stream* stream) { return s->ScoreChunked(context, stream); },
          service)));
}

}  // namespace logprob
