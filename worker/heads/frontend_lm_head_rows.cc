#include "worker/heads/frontend_lm_head_rows.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace logprob {

absl::StatusOr<LmHeadFetchMode> ParseLmHeadFetchMode(const std::string& text) {
  if (text == "never") return LmHeadFetchMode::kNever;
  if (text == "auto") return LmHeadFetchMode::kAuto;
  if (text == "always") return LmHeadFetchMode::kAlways;
  return absl::InvalidArgumentError(absl::StrCat("--fetch-lm-heads ", text, ": never, auto or always"));
}

bool ShouldFetchLmHead(LmHeadFetchMode mode, const internal::v1::LmHeadSource& source) {
  switch (mode) {
    case LmHeadFetchMode::kNever:
      return false;
    case LmHeadFetchMode::kAlways:
      return true;
    case LmHeadFetchMode::kAuto:
      return access(source.file().c_str(), R_OK) != 0 ||
             (!source.bias_file().empty() && access(source.bias_file().c_str(), R_OK) != 0);
  }
  return false;
}

LmHeadRowFetcher FrontendLmHeadRows(std::shared_ptr<internal::v1::Control::Stub> control, int64_t generation,
                                    std::chrono::milliseconds timeout) {
  return [control = std::move(control), generation, timeout](const internal::v1::LmHeadSource& source,
                                                             int64_t row_begin, int64_t row_end, void* rows,
                                                             float* bias) -> absl::Status {
    const uint64_t want_rows =
        static_cast<uint64_t>(row_end - row_begin) * source.hidden_size() * DTypeSize(source.dtype());
    const uint64_t want_bias = bias != nullptr ? static_cast<uint64_t>(row_end - row_begin) : 0;
    internal::v1::LmHeadRowsRequest req;
    *req.mutable_source() = source;
    req.set_row_begin(row_begin);
    req.set_row_end(row_end);
    req.set_generation(generation);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    auto reader = control->ReadLmHeadRows(&ctx, req);
    internal::v1::LmHeadRowsChunk chunk;
    uint64_t got_rows = 0, got_bias = 0;
    bool overflow = false;
    while (reader->Read(&chunk)) {
      if (got_rows + chunk.rows().size() > want_rows || got_bias + chunk.bias_size() > want_bias) {
        overflow = true;
        ctx.TryCancel();
        break;
      }
      if (!chunk.rows().empty())  // a bias-only message; `rows` may be null when no rows are asked
        std::memcpy(static_cast<char*>(rows) + got_rows, chunk.rows().data(), chunk.rows().size());
      got_rows += chunk.rows().size();
      if (chunk.bias_size() > 0)
        std::memcpy(bias + got_bias, chunk.bias().data(), sizeof(float) * static_cast<size_t>(chunk.bias_size()));
      got_bias += static_cast<uint64_t>(chunk.bias_size());
    }
    const grpc::Status st = reader->Finish();
    const std::string what = absl::StrCat("rows [", row_begin, ", ", row_end, ") of ", source.file(),
                                          " from the front-end (--fetch-lm-heads)");
    if (overflow) return absl::DataLossError(absl::StrCat(what, ": more bytes than the slice"));
    if (!st.ok())
      return absl::Status(static_cast<absl::StatusCode>(st.error_code()), absl::StrCat(what, ": ", st.error_message()));
    if (got_rows != want_rows || got_bias != want_bias)
      return absl::DataLossError(absl::StrCat(what, ": ", got_rows, " of ", want_rows, " bytes and ", got_bias, " of ",
                                              want_bias, " bias elements"));
    return absl::OkStatus();
  };
}

}  // namespace logprob
