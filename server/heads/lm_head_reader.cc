#include "server/heads/lm_head_reader.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/lm_head_source.h"
#include "common/status_macros.h"

namespace logprob {

absl::Status ReadLmHeadVersion(const LmHeads& heads, const v1::ReadLmHeadRowsRequest& req, int64_t piece_bytes,
                               const std::function<bool(const v1::LmHeadRowsChunk&)>& write) {
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadName(req.head(), "ReadLmHeadRowsRequest.head"));
  if (!req.version().empty())
    LOGPROB_RETURN_IF_ERROR(CheckLmHeadVersionName(req.version(), "ReadLmHeadRowsRequest.version"));
  // Bound for the whole read: the version's file stays as it is meanwhile.
  LOGPROB_ASSIGN_OR_RETURN(std::shared_ptr<const LmHeadVersion> v, heads.Bind(req.head(), req.version()));
  const LmHeadSource& src = v->source;
  const int64_t V = src.vocab_size;
  const int64_t begin = req.row_begin();
  const int64_t end = req.row_end() == 0 ? V : req.row_end();
  if (begin < 0 || end > V || begin > end)
    return absl::InvalidArgumentError(absl::StrCat("ReadLmHeadRowsRequest: rows [", begin, ", ", end,
                                                   ") are not within [0, ", V, "] of lm_head \"", v->head, "\""));
  v1::LmHeadRowsChunk first;
  v1::LmHeadVersionRows* out = first.mutable_version();
  LOGPROB_ASSIGN_OR_RETURN(*out->mutable_info(), heads.Describe(*v));
  // The digest a peer checks the rows against (computed after an update
  // that announced none: wait for it).
  const std::string sha256 = v->sha256.valid() ? v->sha256.get() : "";
  if (sha256.empty())
    return absl::DataLossError(absl::StrCat("lm_head \"", v->head, "\" version \"", v->version,
                                            "\": its SHA-256 could not be computed (the file could not be read)"));
  out->mutable_info()->set_sha256(sha256);
  out->set_row_begin(begin);
  out->set_row_end(end);
  if (src.transform.has_bias) {
    std::vector<float> bias(static_cast<size_t>(V));
    LOGPROB_RETURN_IF_ERROR(ReadLmHeadBias(src, 0, V, bias.data()));
    v1::Tensor* t = out->mutable_bias();
    t->set_name("lm_head.bias");
    t->set_dtype(v1::F32);
    t->add_shape(V);
    t->set_data(reinterpret_cast<const char*>(bias.data()), bias.size() * sizeof(float));
  }
  if (!write(first)) return absl::CancelledError("ReadLmHeadRows: the caller went away");

  const int64_t row_bytes = src.hidden_size * static_cast<int64_t>(DTypeSize(src.dtype));
  v1::LmHeadRowsChunk part;
  v1::TensorPiece* piece = part.mutable_piece();
  piece->set_tensor(0);
  return ForEachLmHeadRowPiece(src, begin, end, piece_bytes, piece->mutable_data(), [&](int64_t r) {
    piece->set_offset((r - begin) * row_bytes);
    return write(part) ? absl::OkStatus() : absl::CancelledError("ReadLmHeadRows: the caller went away");
  });
}

}  // namespace logprob
