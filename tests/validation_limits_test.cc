// Regression tests for inputs found by the fuzzers (tests/fuzz): empty
// tensors whose other dims are huge.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "common/safetensors.h"
#include "server/core/score_job.h"

namespace logprob {
namespace {

v1::Tensor EmptyTensor(const std::string& name, v1::DType dtype, std::initializer_list<int64_t> shape) {
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

// logits [2^48, 0, 4] with S = 0 are empty, but validation built one
// sequence per b < B: 2^48 push_backs (hang, then out of memory).
TEST(ScoreJobLimits, EmptyPaddedBatchWithHugeBIsRejected) {
  v1::ScoreRequest req;
  *req.add_inputs() = EmptyTensor("logits", v1::F32, {int64_t{1} << 48, 0, 4});
  *req.add_inputs() = EmptyTensor("input_ids", v1::I64, {int64_t{1} << 48, 0});
  req.mutable_options()->set_alignment(v1::SAME_POSITION);
  auto job = BuildScoreJob(req, RequestLimits{});
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(job.status().message().find("max_tokens_per_request"), std::string::npos) << job.status();
}

// logits [1, 0, 2^62]: V = 2^62 was accepted and row bytes V * 4 wrapped to 0.
TEST(ScoreJobLimits, EmptyLogitsWithHugeVocabAreRejected) {
  v1::ScoreRequest req;
  *req.add_inputs() = EmptyTensor("logits", v1::F32, {1, 0, int64_t{1} << 62});
  *req.add_inputs() = EmptyTensor("input_ids", v1::I64, {1, 0});
  req.mutable_options()->set_alignment(v1::SAME_POSITION);
  auto job = BuildScoreJob(req, RequestLimits{});
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(job.status().message().find("too large"), std::string::npos) << job.status();
}

std::string File(const std::string& json) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((json.size() >> (8 * i)) & 0xff));
  return out + json;
}

// F32 [2^62]: numel * 4 wrapped to 0, matching data_offsets [0, 0].
TEST(SafetensorsLimits, ByteSizeThatWrapsIsRejected) {
  auto f = ParseSafetensors(File(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("shape overflows"), std::string::npos) << f.status();
}

// [0, 2^64 - 1]: empty, but the second dim became -1 as int64 (and the file
// did not survive SerializeSafetensors -> ParseSafetensors).
TEST(SafetensorsLimits, EmptyTensorWithDimBeyondInt64IsRejected) {
  auto f = ParseSafetensors(File(R"({"a":{"dtype":"F32","shape":[0,18446744073709551615],"data_offsets":[0,0]}})"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("shape overflows"), std::string::npos) << f.status();
}

TEST(SafetensorsLimits, EmptyTensorsWithOrdinaryDimsStillParse) {
  auto f = ParseSafetensors(File(R"({"a":{"dtype":"I64","shape":[0,50257],"data_offsets":[0,0]}})"));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), 1u);
  EXPECT_EQ(f->tensors[0].shape(1), 50257);
}

}  // namespace
}  // namespace logprob
