// Rollout logprobs in a ScoreJob (server/core/rollout_mismatch.h): what
// validation keeps, what it refuses, and that the rollout options never
// reach the batch key. The estimators' values are checked against numpy
// float64 through a live server (client/python/tests/test_rollout_mismatch.py).
#include "server/core/rollout_mismatch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "server/core/score_job.h"
#include "tests/tensor_values.h"

namespace logprob {
namespace {

template <typename T>
v1::Tensor Make(const std::string& name, v1::DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  return testing::TensorOf(name, dtype, shape, values);
}

/// Packed logits [7, 3] with cu_seqlens {0, 4, 5, 7} (next_token: 3 + 0 + 1 outputs) and `rollout` [4].
v1::ScoreRequest Packed(const std::vector<float>& rollout, v1::DType dtype = v1::F32) {
  v1::ScoreRequest req;
  *req.add_inputs() = Make<float>("logits", v1::F32, {7, 3}, std::vector<float>(21, 0.5f));
  *req.add_inputs() = Make<int64_t>("input_ids", v1::I64, {7}, {0, 1, -100, 2, 1, 0, 2});
  *req.add_inputs() = Make<int64_t>("cu_seqlens", v1::I64, {4}, {0, 4, 5, 7});
  if (dtype == v1::F32) {
    *req.add_inputs() = Make<float>("rollout_logprobs", v1::F32, {static_cast<int64_t>(rollout.size())}, rollout);
  } else {
    *req.add_inputs() = Make<uint16_t>("rollout_logprobs", dtype, {static_cast<int64_t>(rollout.size())},
                                       std::vector<uint16_t>(rollout.size(), 0));
  }
  return req;
}

TEST(RolloutJob, KeepsTheValuesAndTheSequencesOutputs) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  v1::ScoreRequest req = Packed({-0.5f, 7.0f /* ignored target: not read */, -INFINITY, nan});
  req.mutable_options()->set_rollout_ratio_cap(2.5);
  auto job = BuildScoreJob(req, RequestLimits{});
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_NE(job->rollout, nullptr);
  EXPECT_EQ(job->rollout->seq_out, (std::vector<int64_t>{0, 3, 3, 4}));
  EXPECT_EQ(job->rollout->logprobs[0], -0.5f);
  EXPECT_TRUE(std::isinf(job->rollout->logprobs[2]));
  EXPECT_TRUE(std::isnan(job->rollout->logprobs[3]));
  EXPECT_EQ(job->rollout->ratio_cap, 2.5);
  EXPECT_EQ(job->rollout->band_low, 0.9);
  EXPECT_EQ(job->rollout->band_high, 1.1);
}

TEST(RolloutJob, RolloutOptionsStayOutOfTheBatchKey) {
  v1::ScoreRequest a = Packed({-1, -1, -1, -1}), b = a, plain = a;
  b.mutable_options()->set_rollout_ratio_cap(10);
  b.mutable_options()->set_rollout_band_low(0.5);
  b.mutable_options()->set_rollout_band_high(2);
  plain.mutable_inputs()->RemoveLast();
  auto ja = BuildScoreJob(a, RequestLimits{}), jb = BuildScoreJob(b, RequestLimits{}),
       jp = BuildScoreJob(plain, RequestLimits{});
  ASSERT_TRUE(ja.ok() && jb.ok() && jp.ok());
  EXPECT_EQ(jb->rollout->ratio_cap, 10);
  EXPECT_EQ(ja->options.SerializeAsString(), jb->options.SerializeAsString());
  EXPECT_EQ(ja->options.SerializeAsString(), jp->options.SerializeAsString());
  EXPECT_EQ(jp->rollout, nullptr);
}

TEST(RolloutJob, RefusesWhatIsNotARolloutLogprob) {
  struct Case {
    v1::ScoreRequest req;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({Packed({-1, -1, -1, 0.25f}), "value 0.25 of sequence 2 at position 0 is not a log-probability"});
  cases.push_back({Packed({INFINITY, -1, -1, -1}), "value inf of sequence 0 at position 0"});
  cases.push_back({Packed({-1, -1, -1}), "\"rollout_logprobs\": shape [3] does not match the output shape [4]"});
  cases.push_back({Packed({-1, -1, -1, -1}, v1::BF16), "\"rollout_logprobs\": dtype BF16 is not F32"});
  Case cap{Packed({-1, -1, -1, -1}), "options.rollout_ratio_cap must be > 0"};
  cap.req.mutable_options()->set_rollout_ratio_cap(std::nan(""));
  cases.push_back(cap);
  Case band{Packed({-1, -1, -1, -1}), "0 <= low < high, got [0.9, 0.9]"};
  band.req.mutable_options()->set_rollout_band_high(0.9);
  cases.push_back(band);
  for (const Case& c : cases) {
    auto job = BuildScoreJob(c.req, RequestLimits{});
    ASSERT_FALSE(job.ok()) << c.message;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(job.status().message().find(c.message), std::string::npos) << job.status();
  }
}

TEST(RolloutMismatch, LogRatioOfEdgeValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(RolloutLogRatio(-1.0f, -0.25f), -0.75);
  EXPECT_EQ(RolloutLogRatio(-1.0f, -INFINITY), INFINITY);
  EXPECT_EQ(RolloutLogRatio(-INFINITY, -2.0f), -INFINITY);
  EXPECT_TRUE(std::isnan(RolloutLogRatio(-INFINITY, -INFINITY)));
  EXPECT_TRUE(std::isnan(RolloutLogRatio(-1.0f, nan)));
  RolloutInput in;
  MismatchSums sums;
  sums.Add(std::log(2.0), in);  // r = 2: outside the band, k3 term 2 - 1 - log 2
  sums.Add(INFINITY, in);
  EXPECT_EQ(sums.tokens, 2);
  EXPECT_EQ(sums.outside_band, 2);
  EXPECT_EQ(sums.k3, INFINITY);
  MismatchSums one;
  one.Add(std::log(2.0), in);
  EXPECT_NEAR(one.k3, 1 - std::log(2.0), 1e-15);
}

TEST(RolloutMismatch, ResultsThatDoNotFitAreInternal) {
  RolloutInput in;
  in.logprobs = {-1, -1};
  in.seq_out = {0, 2};
  v1::ScoreResponse resp;
  *resp.add_outputs() = Make<float>("token_logprobs", v1::F32, {3}, {-1, -1, -1});
  EXPECT_EQ(AddRolloutMismatch(in, {true, true}, &resp).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace logprob
