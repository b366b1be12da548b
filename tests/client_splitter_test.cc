// Tests of the client's request splitter and response joiner
// (client/request_splitter.h).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "client/request_builder.h"
#include "client/request_splitter.h"
#include "gtest/gtest.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob::client {
namespace {

using v1::ScoreRequest;
using v1::ScoreResponse;
using v1::Tensor;

template <typename T>
Tensor MakeTensor(const std::string& name, v1::DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  Tensor t;
  t.set_name(name);
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
  return t;
}

// n values start, start+1, ... as T.
template <typename T>
std::vector<T> Iota(size_t n, T start = 0) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<T>(start + static_cast<T>(i));
  return v;
}

template <typename T>
std::vector<T> Values(const Tensor& t) {
  std::vector<T> v(t.data().size() / sizeof(T));
  std::memcpy(v.data(), t.data().data(), t.data().size());
  return v;
}

const Tensor& Input(const ScoreRequest& r, const std::string& name) {
  for (const Tensor& t : r.inputs()) {
    if (t.name() == name) return t;
  }
  ADD_FAILURE() << "no input " << name;
  static const Tensor kEmpty;
  return kEmpty;
}

const Tensor& Output(const ScoreResponse& r, const std::string& name) {
  for (const Tensor& t : r.outputs()) {
    if (t.name() == name) return t;
  }
  ADD_FAILURE() << "no output " << name;
  static const Tensor kEmpty;
  return kEmpty;
}

// Checks that the parts' copies of each input of `whole`, concatenated in
// order along dimension 0, have the same bytes and trailing shape
// (cu_seqlens excepted), and that each part fits `max_bytes`.
void ExpectPartsConcatenate(const ScoreRequest& whole, const std::vector<ScoreRequest>& parts, int64_t max_bytes) {
  for (size_t p = 0; p < parts.size(); ++p) {
    EXPECT_LE(static_cast<int64_t>(parts[p].ByteSizeLong()), max_bytes) << "part " << p;
    EXPECT_EQ(parts[p].id(), whole.id() + "-" + std::to_string(p + 1));
    EXPECT_EQ(parts[p].options().SerializeAsString(), whole.options().SerializeAsString());
    ASSERT_EQ(parts[p].inputs_size(), whole.inputs_size());
  }
  for (const Tensor& t : whole.inputs()) {
    if (t.name() == "cu_seqlens") continue;
    std::string bytes;
    int64_t rows = 0;
    for (const ScoreRequest& part : parts) {
      const Tensor& piece = Input(part, t.name());
      EXPECT_EQ(piece.dtype(), t.dtype());
      ASSERT_EQ(piece.shape_size(), t.shape_size());
      for (int d = 1; d < t.shape_size(); ++d) EXPECT_EQ(piece.shape(d), t.shape(d));
      rows += piece.shape(0);
      bytes += piece.data();
    }
    EXPECT_EQ(rows, t.shape(0)) << t.name();
    EXPECT_TRUE(bytes == t.data()) << t.name() << " bytes differ";
  }
}

// Padded request: logits [B, S, V] F32, input_ids [B, S] I64, seq_lens [B]
// I32, gather_indices [B, S-1, K] I64.
ScoreRequest PaddedRequest(int64_t B, int64_t S, int64_t V, int64_t K) {
  ScoreRequest r;
  r.set_id("padded");
  r.mutable_options()->set_entropy(true);
  r.mutable_options()->set_temperature(0.5f);
  *r.add_inputs() = MakeTensor("logits", v1::F32, {B, S, V}, Iota<float>(B * S * V));
  *r.add_inputs() = MakeTensor("input_ids", v1::I64, {B, S}, Iota<int64_t>(B * S, 1000));
  std::vector<int32_t> lens(B);
  for (int64_t b = 0; b < B; ++b) lens[b] = static_cast<int32_t>(S - b % S);
  *r.add_inputs() = MakeTensor("seq_lens", v1::I32, {B}, lens);
  *r.add_inputs() = MakeTensor("gather_indices", v1::I64, {B, S - 1, K}, Iota<int64_t>(B * (S - 1) * K, 7));
  return r;
}

// Packed request with sequences of `lens`: logits [T, V] F32, input_ids
// [T] I32, cu_seqlens [B+1] of `cu_dtype`, gather_indices [T-B or T, K].
ScoreRequest PackedRequest(const std::vector<int64_t>& lens, int64_t V, int64_t K, v1::Alignment alignment,
                           v1::DType cu_dtype) {
  int64_t T = 0;
  std::vector<int64_t> cu = {0};
  for (int64_t l : lens) cu.push_back(T += l);
  const int64_t B = static_cast<int64_t>(lens.size());
  const int64_t out_rows = alignment == v1::NEXT_TOKEN ? T - B : T;
  ScoreRequest r;
  r.set_id("packed");
  r.mutable_options()->set_alignment(alignment);
  *r.add_inputs() = MakeTensor("logits", v1::F32, {T, V}, Iota<float>(T * V, 0.25f));
  *r.add_inputs() = MakeTensor("input_ids", v1::I32, {T}, Iota<int32_t>(T, 5));
  if (cu_dtype == v1::I32) {
    std::vector<int32_t> cu32(cu.begin(), cu.end());
    *r.add_inputs() = MakeTensor("cu_seqlens", v1::I32, {B + 1}, cu32);
  } else {
    *r.add_inputs() = MakeTensor("cu_seqlens", v1::I64, {B + 1}, cu);
  }
  *r.add_inputs() = MakeTensor("gather_indices", v1::I64, {out_rows, K}, Iota<int64_t>(out_rows * K, 3));
  return r;
}

std::vector<int64_t> CuValues(const Tensor& t) {
  std::vector<int64_t> out;
  if (t.dtype() == v1::I32) {
    for (int32_t v : Values<int32_t>(t)) out.push_back(v);
  } else {
    out = Values<int64_t>(t);
  }
  return out;
}

// A stand-in for the server: for each output row, token_logprobs holds
// minus the scored target id, and topk_indices [.., 2] holds (target,
// target + 1).
ScoreResponse FakeScore(const ScoreRequest& r) {
  const bool next = r.options().alignment() == v1::NEXT_TOKEN;
  const Tensor& ids_t = Input(r, "input_ids");
  std::vector<int64_t> ids;
  if (ids_t.dtype() == v1::I32) {
    for (int32_t v : Values<int32_t>(ids_t)) ids.push_back(v);
  } else {
    ids = Values<int64_t>(ids_t);
  }
  std::vector<float> lp;
  std::vector<int64_t> idx;
  std::vector<int64_t> shape;
  const Tensor* cu = nullptr;
  for (const Tensor& t : r.inputs()) {
    if (t.name() == "cu_seqlens") cu = &t;
  }
  if (cu != nullptr) {
    const std::vector<int64_t> c = CuValues(*cu);
    for (size_t s = 0; s + 1 < c.size(); ++s) {
      for (int64_t t = c[s]; t < c[s + 1] - (next ? 1 : 0); ++t) {
        const int64_t target = ids[next ? t + 1 : t];
        lp.push_back(-static_cast<float>(target));
        idx.push_back(target);
        idx.push_back(target + 1);
      }
    }
    shape = {static_cast<int64_t>(lp.size())};
  } else {
    const int64_t B = ids_t.shape(0), S = ids_t.shape(1);
    const int64_t out = next ? S - 1 : S;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < out; ++t) {
        const int64_t target = ids[b * S + (next ? t + 1 : t)];
        lp.push_back(-static_cast<float>(target));
        idx.push_back(target);
        idx.push_back(target + 1);
      }
    }
    shape = {B, out};
  }
  ScoreResponse resp;
  resp.set_id(r.id());
  *resp.add_outputs() = MakeTensor("token_logprobs", v1::F32, shape, lp);
  shape.push_back(2);
  *resp.add_outputs() = MakeTensor("topk_indices", v1::I64, shape, idx);
  return resp;
}

void ExpectSameResponse(const ScoreResponse& a, const ScoreResponse& b) {
  ASSERT_EQ(a.outputs_size(), b.outputs_size());
  for (int i = 0; i < a.outputs_size(); ++i) {
    EXPECT_EQ(a.outputs(i).SerializeAsString(), b.outputs(i).SerializeAsString()) << a.outputs(i).name();
  }
}

TEST(SplitScoreRequest, FittingRequestIsUnchanged) {
  const ScoreRequest r = PaddedRequest(4, 5, 16, 2);
  auto parts = SplitScoreRequest(r, {static_cast<int64_t>(r.ByteSizeLong()), 0});
  ASSERT_TRUE(parts.ok()) << parts.status();
  ASSERT_EQ(parts->size(), 1u);
  EXPECT_EQ((*parts)[0].SerializeAsString(), r.SerializeAsString());
}

TEST(SplitScoreRequest, PaddedSplitsAlongBatch) {
  const int64_t B = 7, S = 5, V = 16, K = 2;
  const ScoreRequest r = PaddedRequest(B, S, V, K);
  // One sequence: 5*16*4 + 5*8 + 4 + 4*2*8 = 428 bytes of tensor data.
  const int64_t max_bytes = 1100;
  auto parts = SplitScoreRequest(r, {max_bytes, 0});
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_GT(parts->size(), 2u);
  ExpectPartsConcatenate(r, *parts, max_bytes);
  for (const ScoreRequest& part : *parts) {
    const int64_t b = Input(part, "logits").shape(0);
    EXPECT_EQ(Input(part, "input_ids").shape(0), b);
    EXPECT_EQ(Input(part, "seq_lens").shape(0), b);
    EXPECT_EQ(Input(part, "gather_indices").shape(0), b);
    EXPECT_EQ(Input(part, "logits").shape(1), S);
  }
}

TEST(SplitScoreRequest, PackedSplitsByWholeSequencesAndRebasesCuSeqlens) {
  for (v1::Alignment alignment : {v1::NEXT_TOKEN, v1::SAME_POSITION}) {
    for (v1::DType cu_dtype : {v1::I32, v1::I64}) {
      SCOPED_TRACE(testing::Message() << "alignment " << alignment << " cu " << cu_dtype);
      const std::vector<int64_t> lens = {3, 7, 2, 8, 1, 5};
      const ScoreRequest r = PackedRequest(lens, 8, 3, alignment, cu_dtype);
      const int64_t max_bytes = 800;
      auto parts = SplitScoreRequest(r, {max_bytes, 0});
      ASSERT_TRUE(parts.ok()) << parts.status();
      EXPECT_GT(parts->size(), 2u);
      ExpectPartsConcatenate(r, *parts, max_bytes);

      // Each part's cu_seqlens starts at 0, ends at its token count, and
      // its lengths are the next whole sequences of the original.
      size_t seq = 0;
      for (const ScoreRequest& part : *parts) {
        const Tensor& cu = Input(part, "cu_seqlens");
        EXPECT_EQ(cu.dtype(), cu_dtype);
        const std::vector<int64_t> c = CuValues(cu);
        ASSERT_GE(c.size(), 2u);
        EXPECT_EQ(cu.shape(0), static_cast<int64_t>(c.size()));
        EXPECT_EQ(c.front(), 0);
        const int64_t t = Input(part, "logits").shape(0);
        EXPECT_EQ(c.back(), t);
        const int64_t b = static_cast<int64_t>(c.size()) - 1;
        EXPECT_EQ(Input(part, "gather_indices").shape(0), alignment == v1::NEXT_TOKEN ? t - b : t);
        for (size_t i = 0; i + 1 < c.size(); ++i) {
          ASSERT_LT(seq, lens.size());
          EXPECT_EQ(c[i + 1] - c[i], lens[seq++]);
        }
      }
      EXPECT_EQ(seq, lens.size());
    }
  }
}

TEST(SplitScoreRequest, PackedSplitsRebaseTheSamplingMask) {
  for (v1::Alignment alignment : {v1::NEXT_TOKEN, v1::SAME_POSITION}) {
    SCOPED_TRACE(testing::Message() << "alignment " << alignment);
    const std::vector<int64_t> lens = {3, 7, 2, 8, 1, 5};
    ScoreRequest r = PackedRequest(lens, 8, 3, alignment, v1::I64);
    const int64_t out_rows = Input(r, "gather_indices").shape(0);
    // Output row o keeps o % 4 ids (0: no mask there).
    std::vector<int64_t> offsets = {0};
    std::vector<int32_t> ids;
    for (int64_t o = 0; o < out_rows; ++o) {
      for (int64_t k = 0; k < o % 4; ++k) ids.push_back(static_cast<int32_t>(k * 2));
      offsets.push_back(static_cast<int64_t>(ids.size()));
    }
    *r.add_inputs() = MakeTensor("sampling_mask_offsets", v1::I64, {out_rows + 1}, offsets);
    *r.add_inputs() = MakeTensor("sampling_mask_ids", v1::I32, {static_cast<int64_t>(ids.size())}, ids);
    const int64_t max_bytes = 900;
    auto parts = SplitScoreRequest(r, {max_bytes, 0});
    ASSERT_TRUE(parts.ok()) << parts.status();
    ASSERT_GT(parts->size(), 2u);
    // Each part: its output rows' offsets rebased to 0 and their ids.
    int64_t row = 0;
    std::vector<int32_t> joined;
    for (const ScoreRequest& part : *parts) {
      EXPECT_LE(static_cast<int64_t>(part.ByteSizeLong()), max_bytes);
      const int64_t rows = Input(part, "gather_indices").shape(0);
      const std::vector<int64_t> off = Values<int64_t>(Input(part, "sampling_mask_offsets"));
      const std::vector<int32_t> got = Values<int32_t>(Input(part, "sampling_mask_ids"));
      ASSERT_EQ(static_cast<int64_t>(off.size()), rows + 1);
      for (int64_t i = 0; i <= rows; ++i) EXPECT_EQ(off[i], offsets[row + i] - offsets[row]) << "row " << row + i;
      EXPECT_EQ(static_cast<int64_t>(got.size()), offsets[row + rows] - offsets[row]);
      joined.insert(joined.end(), got.begin(), got.end());
      row += rows;
    }
    EXPECT_EQ(row, out_rows);
    EXPECT_EQ(joined, ids);
  }
}

TEST(SplitScoreRequest, TokenLimitSplits) {
  const ScoreRequest r = PackedRequest({4, 4, 4, 4}, 8, 1, v1::NEXT_TOKEN, v1::I64);
  auto parts = SplitScoreRequest(r, {1 << 20, 9});
  ASSERT_TRUE(parts.ok()) << parts.status();
  ASSERT_EQ(parts->size(), 2u);
  EXPECT_EQ(Input((*parts)[0], "logits").shape(0), 8);
  EXPECT_EQ(Input((*parts)[1], "logits").shape(0), 8);
}

TEST(SplitScoreRequest, TooLargeSequenceIsAnError) {
  // Sequence 2 has 40 tokens of 8 floats: 1280+ bytes, over the limit.
  const ScoreRequest packed = PackedRequest({3, 4, 40, 2}, 8, 1, v1::NEXT_TOKEN, v1::I32);
  auto parts = SplitScoreRequest(packed, {700, 0});
  ASSERT_FALSE(parts.ok());
  EXPECT_EQ(parts.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parts.status().message().find("sequence 2"), std::string::npos) << parts.status();

  const ScoreRequest padded = PaddedRequest(3, 5, 64, 1);  // 1280+ bytes per sequence
  parts = SplitScoreRequest(padded, {1000, 0});
  ASSERT_FALSE(parts.ok());
  EXPECT_NE(parts.status().message().find("sequence 0"), std::string::npos) << parts.status();
}

TEST(SplitScoreRequest, InconsistentPaddedShapesAreAnError) {
  ScoreRequest r = PaddedRequest(4, 5, 16, 2);
  *r.add_inputs() = MakeTensor("seq_lens2", v1::I32, {3}, Iota<int32_t>(3));
  auto parts = SplitScoreRequest(r, {1000, 0});
  EXPECT_FALSE(parts.ok());
}

TEST(JoinScoreResponses, ConcatenatesInOrder) {
  ScoreResponse a, b;
  *a.add_outputs() = MakeTensor("token_logprobs", v1::F32, {2, 3}, Iota<float>(6, -6.0f));
  *a.add_outputs() = MakeTensor("topk_indices", v1::I64, {2, 3, 2}, Iota<int64_t>(12, 0));
  *b.add_outputs() = MakeTensor("topk_indices", v1::I64, {1, 3, 2}, Iota<int64_t>(6, 12));
  *b.add_outputs() = MakeTensor("token_logprobs", v1::F32, {1, 3}, Iota<float>(3, 0.0f));
  auto joined = JoinScoreResponses({a, b}, "base");
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->id(), "base");
  const Tensor& lp = Output(*joined, "token_logprobs");
  EXPECT_EQ(lp.dtype(), v1::F32);
  ASSERT_EQ(lp.shape_size(), 2);
  EXPECT_EQ(lp.shape(0), 3);
  EXPECT_EQ(lp.shape(1), 3);
  EXPECT_EQ(Values<float>(lp), Iota<float>(9, -6.0f));
  const Tensor& idx = Output(*joined, "topk_indices");
  ASSERT_EQ(idx.shape_size(), 3);
  EXPECT_EQ(idx.shape(0), 3);
  EXPECT_EQ(Values<int64_t>(idx), Iota<int64_t>(18, 0));
}

TEST(JoinScoreResponses, MismatchesAreErrors) {
  ScoreResponse a, b;
  *a.add_outputs() = MakeTensor("token_logprobs", v1::F32, {2, 3}, Iota<float>(6));
  *b.add_outputs() = MakeTensor("token_logprobs", v1::F32, {1, 4}, Iota<float>(4));
  EXPECT_FALSE(JoinScoreResponses({a, b}, "x").ok());  // trailing dims differ

  ScoreResponse c;
  *c.add_outputs() = MakeTensor("entropy", v1::F32, {1, 3}, Iota<float>(3));
  EXPECT_FALSE(JoinScoreResponses({a, c}, "x").ok());  // names differ

  ScoreResponse failed;
  failed.set_status_code(static_cast<int>(absl::StatusCode::kInvalidArgument));
  failed.set_status_message("bad target");
  auto joined = JoinScoreResponses({a, failed}, "x");
  ASSERT_FALSE(joined.ok());
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_FALSE(JoinScoreResponses({}, "x").ok());
}

// Scoring the parts and joining equals scoring the whole request.
TEST(SplitAndJoin, EqualsUnsplitResult) {
  std::vector<ScoreRequest> requests = {
      PaddedRequest(9, 6, 8, 1),
      PackedRequest({5, 1, 9, 4, 7, 2, 6}, 8, 1, v1::NEXT_TOKEN, v1::I32),
      PackedRequest({5, 1, 9, 4, 7, 2, 6}, 8, 1, v1::SAME_POSITION, v1::I64),
  };
  for (const ScoreRequest& r : requests) {
    SCOPED_TRACE(r.id());
    auto parts = SplitScoreRequest(r, {700, 0});
    ASSERT_TRUE(parts.ok()) << parts.status();
    ASSERT_GT(parts->size(), 1u);
    std::vector<ScoreResponse> responses;
    for (const ScoreRequest& part : *parts) responses.push_back(FakeScore(part));
    auto joined = JoinScoreResponses(std::move(responses), r.id());
    ASSERT_TRUE(joined.ok()) << joined.status();
    EXPECT_EQ(joined->id(), r.id());
    ExpectSameResponse(*joined, FakeScore(r));
  }
}

// The token positions the CLI reports as scored: each sequence's length
// (seq_lens, cu_seqlens, else S) less one for next_token, less ignored
// targets; padding and unreadable inputs are not counted.
TEST(CountScoredTokens, LeavesOutPaddingLastPositionsAndIgnoredTargets) {
  const auto bytes_of = [](const ScoreRequest* r) {
    return [r](const std::string& name) -> std::string_view { return Input(*r, name).data(); };
  };
  ScoreRequest padded;  // [2, 5]: 2 * 4 next-token targets
  *padded.add_inputs() = MakeTensor<int64_t>("input_ids", v1::I64, {2, 5}, Iota<int64_t>(10, 1));
  EXPECT_EQ(CountScoredTokens(padded, bytes_of(&padded)), 8);
  EXPECT_EQ(CountInputTokens(padded), 0);  // no logits / hidden_states: rows unknown
  padded.mutable_options()->set_alignment(v1::SAME_POSITION);
  EXPECT_EQ(CountScoredTokens(padded, bytes_of(&padded)), 10);
  padded.mutable_options()->set_alignment(v1::NEXT_TOKEN);
  *padded.add_inputs() = MakeTensor<int32_t>("seq_lens", v1::I32, {2}, {3, 0});  // 2 + 0 targets
  EXPECT_EQ(CountScoredTokens(padded, bytes_of(&padded)), 2);

  ScoreRequest ignored;  // -100 (the default ignore_index) as a target, and as a first token (no target)
  *ignored.add_inputs() = MakeTensor<int32_t>("input_ids", v1::I32, {1, 4}, {-100, 5, -100, 7});
  EXPECT_EQ(CountScoredTokens(ignored, bytes_of(&ignored)), 2);
  ignored.mutable_options()->set_ignore_index(7);
  EXPECT_EQ(CountScoredTokens(ignored, bytes_of(&ignored)), 2);  // -100 is scored now (the server refuses it)

  ScoreRequest packed;  // T = 9 in sequences of 4, 1 and 4: 3 + 0 + 3 targets
  *packed.add_inputs() = MakeTensor<int64_t>("input_ids", v1::I64, {9}, Iota<int64_t>(9));
  *packed.add_inputs() = MakeTensor<int64_t>("cu_seqlens", v1::I64, {4}, {0, 4, 5, 9});
  EXPECT_EQ(CountScoredTokens(packed, bytes_of(&packed)), 6);

  ScoreRequest bad;  // cu_seqlens past T, and a wrong dtype: unknown
  *bad.add_inputs() = MakeTensor<int64_t>("input_ids", v1::I64, {4}, Iota<int64_t>(4));
  *bad.add_inputs() = MakeTensor<int64_t>("cu_seqlens", v1::I64, {2}, {0, 5});
  EXPECT_EQ(CountScoredTokens(bad, bytes_of(&bad)), -1);
  ScoreRequest floats;
  *floats.add_inputs() = MakeTensor<float>("input_ids", v1::F32, {2}, {1, 2});
  EXPECT_EQ(CountScoredTokens(floats, bytes_of(&floats)), -1);
}

}  // namespace
}  // namespace logprob::client
