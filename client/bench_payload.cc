#include "client/bench_payload.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/request_builder.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace logprob::client {
namespace {

// Elements of the random pattern that fills the logits.
constexpr size_t kPatternElements = size_t{1} << 20;
// gRPC cannot carry a message of 2 GiB or more.
constexpr int64_t kMaxLogitsBytes = (int64_t{1} << 31) - (int64_t{1} << 20);

v1::Tensor* AddTensor(v1::ScoreRequest* req, const char* name, v1::DType dtype, std::vector<int64_t> shape) {
  v1::Tensor* t = req->add_inputs();
  t->set_name(name);
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  return t;
}

// `bytes` bytes of `dtype` values uniform in [-8, 8): a random pattern of
// kPatternElements elements, repeated.
std::string RandomFloats(v1::DType dtype, size_t bytes, float range, std::mt19937_64& rng) {
  const size_t elem = DTypeSize(dtype);
  std::uniform_real_distribution<float> uniform(-range, range);
  std::string pattern(std::min(bytes / elem, kPatternElements) * elem, '\0');
  for (size_t i = 0; i < pattern.size(); i += elem) {
    const float f = uniform(rng);
    if (dtype == v1::F32) {
      std::memcpy(&pattern[i], &f, 4);
    } else {
      const uint16_t h = dtype == v1::BF16 ? FloatToBf16(f) : FloatToF16(f);
      std::memcpy(&pattern[i], &h, 2);
    }
  }
  std::string out;
  out.reserve(bytes);
  while (out.size() < bytes) out.append(pattern, 0, std::min(pattern.size(), bytes - out.size()));
  return out;
}

}  // namespace

int64_t ShapeTokens(const BenchShape& s) { return s.packed_tokens > 0 ? s.packed_tokens : s.batch * s.seq; }

absl::Status ValidateBenchShape(const BenchShape& s) {
  if (s.batch <= 0) return absl::InvalidArgumentError(absl::StrCat("--batch ", s.batch, ": must be > 0"));
  if (s.vocab <= 0) return absl::InvalidArgumentError(absl::StrCat("--vocab ", s.vocab, ": must be > 0"));
  if (s.hidden < 0) return absl::InvalidArgumentError(absl::StrCat("--hidden-size ", s.hidden, ": must be > 0"));
  if (s.packed_tokens < 0)
    return absl::InvalidArgumentError(absl::StrCat("--packed ", s.packed_tokens, ": must be > 0"));
  if (s.packed_tokens > 0 && s.packed_tokens < s.batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("--packed ", s.packed_tokens, ": fewer tokens than the --batch ", s.batch, " sequences"));
  }
  if (s.packed_tokens == 0 && s.seq <= 0)
    return absl::InvalidArgumentError(absl::StrCat("--seq ", s.seq, ": must be > 0"));
  if (!IsFloatDType(s.dtype)) return absl::InvalidArgumentError("--dtype: must be bf16, f16 or f32");
  const int64_t tokens = ShapeTokens(s);
  const int64_t elem = static_cast<int64_t>(DTypeSize(s.dtype));
  if (tokens > kMaxLogitsBytes / elem / RowWidth(s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--batch/--seq/--packed/", s.hidden > 0 ? "--hidden-size: " : "--vocab: ", tokens, " x ", RowWidth(s), " ",
        DTypeName(s.dtype), s.hidden > 0 ? " hidden states" : " logits", " are over gRPC's 2 GiB message limit"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ScoreRequest> BuildBenchRequest(const BenchShape& s, const v1::ScoreOptions& options,
                                                   const std::string& id) {
  LOGPROB_RETURN_IF_ERROR(ValidateBenchShape(s));
  std::mt19937_64 rng(20261121);
  const int64_t tokens = ShapeTokens(s);
  const bool packed = s.packed_tokens > 0;
  v1::ScoreRequest req;
  req.set_id(id);
  *req.mutable_options() = options;

  const int64_t width = RowWidth(s);
  v1::Tensor* rows =
      AddTensor(&req, s.hidden > 0 ? kHiddenStatesName : kLogitsName, s.dtype,
                packed ? std::vector<int64_t>{tokens, width} : std::vector<int64_t>{s.batch, s.seq, width});
  *rows->mutable_data() =
      RandomFloats(s.dtype, static_cast<size_t>(tokens * width) * DTypeSize(s.dtype), s.hidden > 0 ? 1.f : 8.f, rng);

  std::vector<int64_t> ids(static_cast<size_t>(tokens));
  std::uniform_int_distribution<int64_t> target(0, s.vocab - 1);
  for (int64_t& v : ids) v = target(rng);
  AddTensor(&req, kInputIdsName, v1::I64, packed ? std::vector<int64_t>{tokens} : std::vector<int64_t>{s.batch, s.seq})
      ->set_data(ids.data(), ids.size() * sizeof(int64_t));

  if (packed) {
    std::vector<int64_t> cu(static_cast<size_t>(s.batch) + 1);
    for (int64_t b = 0; b <= s.batch; ++b) cu[b] = tokens * b / s.batch;
    AddTensor(&req, kCuSeqlensName, v1::I64, {s.batch + 1})->set_data(cu.data(), cu.size() * sizeof(int64_t));
  }
  return req;
}

}  // namespace logprob::client
