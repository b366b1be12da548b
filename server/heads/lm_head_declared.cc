#include "server/heads/lm_head_declared.h"

#include <cstdint>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "common/partition.h"
#include "common/status_macros.h"

namespace logprob {

absl::StatusOr<LmHeadVersion> ParseDeclaredLmHead(const std::string& arg, int workers) {
  const auto bad = [&arg](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lm-head-declare ", arg, ": ", why, " (expected NAME=VxH:DTYPE, e.g. policy=151936x4096:bf16)"));
  };
  const size_t eq = arg.find('=');
  if (eq == std::string::npos) return bad("no NAME=");
  LmHeadVersion v;
  v.head = arg.substr(0, eq);
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadName(v.head, "--lm-head-declare NAME"));
  const std::vector<std::string> shape_dtype = absl::StrSplit(arg.substr(eq + 1), ':');
  if (shape_dtype.size() != 2) return bad("no :DTYPE after the shape");
  const std::vector<std::string> dims = absl::StrSplit(shape_dtype[0], 'x');
  int64_t V = 0, H = 0;
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (dims.size() != 2 || !absl::SimpleAtoi(dims[0], &V) || !absl::SimpleAtoi(dims[1], &H) || V <= 0 || H <= 0 ||
      V > kMax || H > kMax)
    return bad("the shape must be VxH with V and H integers in [1, 2^31)");
  DType dtype = v1::DTYPE_UNSPECIFIED;
  if (!ParseDTypeName(absl::AsciiStrToUpper(shape_dtype[1]), &dtype) || !IsFloatDType(dtype))
    return bad(absl::StrCat("dtype \"", shape_dtype[1], "\" is not bf16, f16 or f32"));
  v.origin = kDeclaredOrigin;
  v.sha256 = KnownSha256("");
  v.source.tensor = kLmHeadTensor;
  v.source.dtype = dtype;
  v.source.vocab_size = V;
  v.source.hidden_size = H;
  v.bytes_per_worker = SplitRange(V, workers, 0).second * H * static_cast<int64_t>(DTypeSize(dtype));
  return v;
}

}  // namespace logprob
