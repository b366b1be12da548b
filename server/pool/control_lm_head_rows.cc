// Control.ReadLmHeadRows: a worker's vocabulary slice of an lm_head file,
// read by the front-end and streamed to a worker that cannot read the file
// itself (logprob-worker --fetch-lm-heads; docs/cluster.md "Heads without
// a shared filesystem").
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/lm_head_source.h"
#include "common/lm_head_source_proto.h"
#include "common/log_line.h"
#include "common/untrusted_text.h"
#include "server/pool/control_service.h"

namespace logprob {
namespace {
// Bytes of rows (or of bias) per message: well under gRPC's default 4 MiB
// receive limit, whatever the worker's channel allows.
constexpr int64_t kPieceBytes = int64_t{1} << 20;

/// OK when `elements` of `elem_bytes` each from `offset` lie inside `file`
/// (its size now): a request's shape is checked against the bytes that
/// exist before anything is allocated by it. INVALID_ARGUMENT otherwise.
absl::Status InsideFile(const std::string& file, uint64_t offset, int64_t rows, int64_t cols, size_t elem_bytes,
                        const char* what) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(file, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("ReadLmHeadRows: ", Printable(file), ": ", ec.message()));
  if (rows < 0 || cols < 0)
    return absl::InvalidArgumentError(absl::StrCat("ReadLmHeadRows: a negative ", what, " shape"));
  const unsigned __int128 end = static_cast<unsigned __int128>(offset) + static_cast<unsigned __int128>(rows) *
                                                                             static_cast<unsigned __int128>(cols) *
                                                                             elem_bytes;
  if (end > size)
    return absl::InvalidArgumentError(absl::StrCat("ReadLmHeadRows: the ", what, " ([", rows, ", ", cols, "] at byte ",
                                                   offset, ") does not lie inside ", Printable(file), " of ", size,
                                                   " bytes"));
  return absl::OkStatus();
}
}  // namespace

grpc::Status ControlService::ReadLmHeadRows(grpc::ServerContext* ctx, const internal::v1::LmHeadRowsRequest* req,
                                            grpc::ServerWriter<internal::v1::LmHeadRowsChunk>* writer) {
  if (grpc::Status st = auth_.Check(*ctx, "Control.ReadLmHeadRows"); !st.ok()) return st;
  if (grpc::Status st = CheckMember(req->generation()); !st.ok()) return st;
  const internal::v1::LmHeadSource& src = req->source();
  for (const std::string& file : {src.file(), src.bias_file()})
    if (!file.empty() && (!lm_head_files_ || !lm_head_files_(file)))
      return grpc::Status(
          grpc::StatusCode::PERMISSION_DENIED,
          absl::StrCat("ReadLmHeadRows: ", Printable(file), " is not an lm_head file this front-end serves"));
  absl::StatusOr<LmHeadSource> source = LmHeadSourceFromProto(src, "ReadLmHeadRows");
  if (!source.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(source.status().message()));
  if (source->hidden_size > (int64_t{1} << 24))
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("ReadLmHeadRows: hidden_size ", source->hidden_size, " is over 2^24"));
  if (absl::Status st = InsideFile(source->file, source->data_offset, source->vocab_size, source->hidden_size,
                                   DTypeSize(source->dtype), "weight");
      !st.ok())
    return ToGrpc(st);
  if (source->transform.has_bias)
    if (absl::Status st = InsideFile(source->bias.file, source->bias.data_offset, source->vocab_size, 1,
                                     DTypeSize(source->bias.dtype), "bias");
        !st.ok())
      return ToGrpc(st);
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
  LogLine() << absl::StrCat("logprob-server: sent rows [", begin, ", ", end, ") of ", Printable(src.file()),
                            " to worker ", Printable(ctx->peer()));
  return grpc::Status::OK;
}

}  // namespace logprob
