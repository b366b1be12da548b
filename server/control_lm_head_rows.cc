// Control.ReadLmHeadRows: a worker's vocabulary slice of an lm_head file,
// read by the front-end and streamed to a worker that cannot read the file
// itself (logprob-worker --fetch-lm-heads; docs/cluster.md "Heads without
// a shared filesystem").
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/lm_head_source.h"
#include "common/lm_head_source_proto.h"
#include "common/log_line.h"
#include "server/control_service.h"

namespace logprob {
namespace {
// Bytes of rows (or of bias) per message: well under gRPC's default 4 MiB
// receive limit, whatever the worker's channel allows.
constexpr int64_t kPieceBytes = int64_t{1} << 20;
}  // namespace

grpc::Status ControlService::ReadLmHeadRows(grpc::ServerContext* ctx, const internal::v1::LmHeadRowsRequest* req,
                                            grpc::ServerWriter<internal::v1::LmHeadRowsChunk>* writer) {
  const internal::v1::LmHeadSource& src = req->source();
  for (const std::string& file : {src.file(), src.bias_file()})
    if (!file.empty() && (!lm_head_files_ || !lm_head_files_(file)))
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          absl::StrCat("ReadLmHeadRows: ", file, " is not an lm_head file this front-end serves"));
  absl::StatusOr<LmHeadSource> source = LmHeadSourceFromProto(src, "ReadLmHeadRows");
  if (!source.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(source.status().message()));
  const int64_t begin = req->row_begin(), end = req->row_end();
  if (begin < 0 || begin > end || end > source->vocab_size)
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("ReadLmHeadRows: rows [", begin, ", ", end,
                                                                         ") outside [0, ", source->vocab_size, "]"));
  internal::v1::LmHeadRowsChunk chunk;
  const auto send = [&]() -> absl::Status {
    if (ctx->IsCancelled() || !writer->Write(chunk))
      return absl::CancelledError("ReadLmHeadRows: the worker went away");
    return absl::OkStatus();
  };
  if (source->transform.has_bias) {
    std::vector<float> bias(static_cast<size_t>(end - begin));
    if (absl::Status st = ReadLmHeadBias(*source, begin, end, bias.data()); !st.ok()) return ToGrpc(st);
    const size_t per_piece = kPieceBytes / sizeof(float);
    for (size_t i = 0; i < bias.size(); i += per_piece) {
      const size_t n = std::min(per_piece, bias.size() - i);
      chunk.mutable_bias()->Assign(bias.begin() + static_cast<ptrdiff_t>(i),
                                   bias.begin() + static_cast<ptrdiff_t>(i + n));
      if (absl::Status st = send(); !st.ok()) return ToGrpc(st);
      chunk.Clear();
    }
  }
  // One message at least (an empty range: one without rows).
  const absl::Status st = begin == end ? send()
                                       : ForEachLmHeadRowPiece(*source, begin, end, kPieceBytes, chunk.mutable_rows(),
                                                               [&](int64_t) { return send(); });
  if (!st.ok()) return ToGrpc(st);
  LogLine() << absl::StrCat("logprob-server: sent rows [", begin, ", ", end, ") of ", src.file(), " to worker ",
                            ctx->peer());
  return grpc::Status::OK;
}

}  // namespace logprob
