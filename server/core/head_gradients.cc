#include "server/core/head_gradients.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/partition.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"

namespace logprob {

bool ValidGradientStepKey(const std::string& key) {
  if (key.empty() || key.size() > 128) return false;
  for (char c : key)
    // c != '\0': strchr finds the terminator of its set.
    if (!(std::isalnum(static_cast<unsigned char>(c)) || (c != '\0' && std::strchr("._:/+-", c) != nullptr)))
      return false;
  return true;
}

absl::Status CheckGradientStepKey(const std::string& key, const std::string& field) {
  if (!ValidGradientStepKey(key))
    return absl::InvalidArgumentError(field + " must be 1..128 characters of [A-Za-z0-9._:/+-]");
  return absl::OkStatus();
}

absl::Status ReadHeadGradients(const LmHeads& heads, const GradientStepWorkers& workers,
                               const v1::ReadHeadGradientsRequest& req,
                               const std::function<bool(const v1::HeadGradientsChunk&)>& write) {
  LOGPROB_RETURN_IF_ERROR(CheckGradientStepKey(req.gradient_step(), "gradient_step"));
  LOGPROB_ASSIGN_OR_RETURN(const std::shared_ptr<const LmHeadVersion> head, heads.Bind(req.head(), ""));
  const int64_t V = head->source.vocab_size, H = head->source.hidden_size;
  int64_t begin = req.row_begin(), end = req.row_end();
  if (begin == 0 && end == 0) end = V;
  if (begin < 0 || end < begin || end > V)
    return absl::InvalidArgumentError(
        absl::StrCat("rows [", begin, ", ", end, ") are outside the head's [0, V = ", V, "]"));
  const int64_t piece_bytes = req.max_piece_bytes() == 0 ? kDefaultGradientPieceBytes : req.max_piece_bytes();
  if (piece_bytes < 0 || piece_bytes > kMaxGradientPieceBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("max_piece_bytes must be in [0, ", kMaxGradientPieceBytes, "], got ", piece_bytes));
  const int64_t piece_rows = std::max<int64_t>(1, piece_bytes / (4 * (H + 1)));
  const int W = workers.size;
  // One piece of rows [r, e) (of rank's slice [vb, ...)), checked and written.
  auto piece_of = [&](int rank, int64_t vb, int64_t r, int64_t e) -> absl::Status {
    internal::v1::WorkerHeadGradientsRequest ask;
    ask.set_gradient_step(req.gradient_step());
    ask.set_row_begin(r - vb);
    ask.set_row_end(e - vb);
    LOGPROB_ASSIGN_OR_RETURN(v1::HeadGradientsChunk piece, workers.read(rank, ask));
    if (piece.head() != head->head)
      return absl::InvalidArgumentError(absl::StrCat("gradient step '", req.gradient_step(), "' accumulates head '",
                                                     Printable(piece.head()), "', not '", head->head, "'"));
    if (piece.hidden_size() != H || piece.weight().size() != static_cast<size_t>((e - r) * H) * sizeof(float) ||
        (piece.has_bias() && piece.bias().size() != static_cast<size_t>(e - r) * sizeof(float)))
      return absl::InternalError(absl::StrCat("worker rank ", rank, " answered a malformed gradient piece"));
    piece.set_row_begin(r);
    piece.set_vocab_size(V);
    if (!write(piece)) return absl::CancelledError("the caller went away");
    return absl::OkStatus();
  };
  if (begin == end) return piece_of(0, 0, 0, 0);  // no rows: what the step covers
  for (int rank = 0; rank < W; ++rank) {
    const auto [vb, ve] = SplitRange(V, W, rank);
    for (int64_t r = std::max(begin, vb); r < std::min(end, ve); r += piece_rows)
      LOGPROB_RETURN_IF_ERROR(piece_of(rank, vb, r, std::min({end, ve, r + piece_rows})));
  }
  return absl::OkStatus();
}

absl::Status CloseHeadGradientStep(const GradientStepWorkers& workers, const v1::CloseHeadGradientStepRequest& req) {
  LOGPROB_RETURN_IF_ERROR(CheckGradientStepKey(req.gradient_step(), "gradient_step"));
  return workers.close(req.gradient_step());
}

}  // namespace logprob
