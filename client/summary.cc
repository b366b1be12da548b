#include "client/summary.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"

namespace logprob::client {

std::string SummarizeScore(const std::vector<v1::Tensor>& outputs, int64_t scored_tokens, int64_t input_rows,
                           double seconds, int parts) {
  std::string out;
  for (const v1::Tensor& t : outputs) {
    absl::StrAppend(&out, t.name(), " ", DTypeName(t.dtype()), " [", absl::StrJoin(t.shape(), ", "), "]");
    if (t.name() == "token_logprobs" && t.dtype() == v1::F32) {
      const size_t n = t.data().size() / sizeof(float);
      double sum = 0;
      int64_t count = 0, neg_inf = 0;
      for (size_t i = 0; i < n; ++i) {
        float v;
        std::memcpy(&v, t.data().data() + i * sizeof(float), sizeof v);
        if (v == 0.0f) continue;
        if (std::isinf(v) && v < 0) {
          ++neg_inf;
        } else {
          sum += v;
          ++count;
        }
      }
      if (count > 0) {
        absl::StrAppendFormat(&out, " mean %.6f over %d non-zero values", sum / count, count);
      } else {
        absl::StrAppend(&out, " no non-zero values");
      }
      if (neg_inf > 0) absl::StrAppend(&out, " (", neg_inf, " -inf)");
      // The first few values, so a person sees real numbers.
      const size_t show = std::min<size_t>(n, 8);
      absl::StrAppend(&out, "\n  first ", show, ":");
      for (size_t i = 0; i < show; ++i) {
        float v;
        std::memcpy(&v, t.data().data() + i * sizeof(float), sizeof v);
        absl::StrAppendFormat(&out, " %.4f", v);
      }
    }
    absl::StrAppend(&out, "\n");
  }
  const int64_t tokens = scored_tokens >= 0 ? scored_tokens : input_rows;
  const double rate = seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
  if (scored_tokens < 0) {
    absl::StrAppendFormat(&out, "scored %d input rows in %.3f s (%.0f rows/s)", input_rows, seconds, rate);
  } else if (scored_tokens == input_rows) {
    absl::StrAppendFormat(&out, "scored %d tokens in %.3f s (%.0f tokens/s)", tokens, seconds, rate);
  } else {
    absl::StrAppendFormat(&out, "scored %d tokens (of %d input rows) in %.3f s (%.0f tokens/s)", tokens, input_rows,
                          seconds, rate);
  }
  if (parts > 1) absl::StrAppend(&out, " in ", parts, " requests");
  absl::StrAppend(&out, "\n");
  return out;
}

}  // namespace logprob::client
