#include "common/lm_head_precision.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace logprob {

absl::StatusOr<LmHeadPrecision> ParseLmHeadPrecision(std::string_view value, std::string_view flag) {
  for (LmHeadPrecision p :
       {LmHeadPrecision::kAuto, LmHeadPrecision::kBf16, LmHeadPrecision::kTf32, LmHeadPrecision::kFp32})
    if (value == LmHeadPrecisionName(p)) return p;
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(flag), " '", std::string(value), "': must be auto, bf16, tf32 or fp32"));
}

const char* LmHeadPrecisionName(LmHeadPrecision p) {
  switch (p) {
    case LmHeadPrecision::kBf16:
      return "bf16";
    case LmHeadPrecision::kTf32:
      return "tf32";
    case LmHeadPrecision::kFp32:
      return "fp32";
    default:
      return "auto";
  }
}

LmHeadPrecision ResolveLmHeadPrecision(LmHeadPrecision p, DType weight_dtype) {
  if (p != LmHeadPrecision::kAuto) return p;
  return weight_dtype == v1::BF16 ? LmHeadPrecision::kBf16 : LmHeadPrecision::kFp32;
}

int64_t LmHeadWorkerBytes(int64_t rows, int64_t hidden_size, DType weight_dtype, LmHeadPrecision p, bool device) {
  size_t element = DTypeSize(weight_dtype);
  if (device) element = ResolveLmHeadPrecision(p, weight_dtype) == LmHeadPrecision::kBf16 ? 2 : 4;
  return rows * hidden_size * static_cast<int64_t>(element);
}

}  // namespace logprob
