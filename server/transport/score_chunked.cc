// ScoringService::ServeChunked: a ScoreChunked request received in pieces.
#include <chrono>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/chunk_assembler.h"
#include "common/grpc_status.h"
#include "server/transport/call_ended.h"
#include "server/transport/scoring_service.h"

namespace logprob {

namespace {

constexpr char kMethod[] = "ScoreChunked";

using Stream = chunked::ServerStream;

}  // namespace

absl::Status ScoringService::ReceiveChunked(grpc::ServerContext* context, Stream* stream, v1::ScoreRequest* req,
                                            std::vector<int>* pooled, Receipt* received) {
  // The bytes count as admitted work from the announcement on
  // (backpressure); ScoreOne admits the assembled request into the same
  // ticket, so they count once until the answer.
  auto admit = [&](const v1::ScoreRequest& header, int64_t pending) -> absl::Status {
    const int64_t total = static_cast<int64_t>(header.ByteSizeLong()) + pending;
    if (total > core_.config().max_request_bytes)
      return absl::ResourceExhaustedError(
          absl::StrCat("chunked request ", header.id(), " announces ", total, " bytes (", pending,
                       " in pieces), over the server's max_request_bytes ", core_.config().max_request_bytes));
    return core_.admission().Resize(received, 0, total);
  };
  return chunked::ReadChunkedRequest([stream](chunked::IncomingPart* in) { return stream->Read(in); },
                                     [context] { return CallEnded(context); }, admit,
                                     [this](size_t n) { return assembly_buffers_.Acquire(n); }, req, pooled);
}

grpc::Status ScoringService::ServeChunked(grpc::ServerContext* context, Stream* stream) {
  if (grpc::Status st = Authorize(context, kMethod); !st.ok()) return st;
  Receipt received;  // the request's bytes in the admission: released after its buffers and answer
  v1::ScoreRequest req;
  std::vector<int> pooled;
  absl::StatusOr<v1::ScoreResponse> r =
      Observe(kMethod, req, [&](RequestStats* stats) -> absl::StatusOr<v1::ScoreResponse> {
        const auto t0 = std::chrono::steady_clock::now();
        absl::Status arrived = ReceiveChunked(context, stream, &req, &pooled, &received);
        stats->receive_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!arrived.ok()) return arrived;
        return ScoreOne(req, stats, context, &received);
      });
  for (int i : pooled) assembly_buffers_.Release(std::move(*req.mutable_inputs(i)->mutable_data()));
  if (!r.ok()) return Reply(context, r.status());
  if (!chunked::WriteChunkedResponse([stream](const chunked::OutgoingPart& p) { return stream->Write(p); },
                                     *std::move(r), kResponsePieceBytes, chunked::kDefaultInlineBytes))
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away before the answer was sent");
  return grpc::Status::OK;
}

}  // namespace logprob
