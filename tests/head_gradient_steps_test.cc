// The worker's per-step sums of the lm_head's weight and bias gradients
// (worker/gradients/head_gradient_steps.h): micro-batches add up, pieces
// read back, a step is bound to its head version and shape, closed keys
// are refused, the byte budget and the idle timeout hold, a failed add
// drops the step unless it added nothing (NothingAdded), an empty read says
// what the step covers. Time is passed in: nothing sleeps.
#include "worker/gradients/head_gradient_steps.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace logprob {
namespace {

constexpr int64_t kRows = 5, kH = 3;
const absl::Time t0 = absl::FromUnixSeconds(1000);

/// An add of `value` to every element of the sums.
std::function<absl::Status(HeadGradientSums&)> AddValue(float value) {
  return [value](HeadGradientSums& s) {
    for (float& x : s.weight) x += value;
    for (float& x : s.bias) x += value;
    return absl::OkStatus();
  };
}

TEST(HeadGradientSteps, MicroBatchesAddUpAndReadBackInPieces) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  for (float v : {1.0f, 2.0f, 4.0f})
    ASSERT_TRUE(steps.Accumulate("run/step-1", "policy", "v1", kRows, kH, true, 10, AddValue(v), t0).ok());
  EXPECT_EQ(steps.bytes(), kRows * (kH + 1) * 4);
  auto piece = steps.Read("run/step-1", 1, 3, t0);
  ASSERT_TRUE(piece.ok()) << piece.status();
  EXPECT_EQ(piece->weight, std::vector<float>(2 * kH, 7.0f));
  EXPECT_EQ(piece->bias, std::vector<float>(2, 7.0f));
  EXPECT_EQ(piece->micro_batches, 3);
  EXPECT_EQ(piece->tokens, 30);
  EXPECT_EQ(piece->rows, kRows);
  EXPECT_EQ(piece->version, "v1");
  EXPECT_EQ(steps.Read("run/step-1", 3, 6, t0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(steps.Read("never", 0, 1, t0).status().code(), absl::StatusCode::kNotFound);
}

TEST(HeadGradientSteps, ConcurrentBackwardsOfOneStepAllCount) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&] {
      for (int i = 0; i < 50; ++i)
        EXPECT_TRUE(steps.Accumulate("s", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
    });
  for (auto& t : ranks) t.join();
  auto all = steps.Read("s", 0, kRows, t0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->weight, std::vector<float>(kRows * kH, 200.0f));
  EXPECT_TRUE(all->bias.empty());
  EXPECT_EQ(all->micro_batches, 200);
}

TEST(HeadGradientSteps, AStepIsBoundToItsHeadVersionAndShape) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  ASSERT_TRUE(steps.Accumulate("s", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  EXPECT_EQ(steps.Accumulate("s", "policy", "v2", kRows, kH, false, 1, AddValue(1.0f), t0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(steps.Accumulate("s", "reference", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(steps.Accumulate("s", "policy", "v1", kRows, kH + 1, false, 1, AddValue(1.0f), t0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(steps.Accumulate("s", "policy", "v1", kRows, kH, true, 1, AddValue(1.0f), t0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(steps.Accumulate("", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).code(),
            absl::StatusCode::kInvalidArgument);
  auto sums = steps.Read("s", 0, 1, t0);
  ASSERT_TRUE(sums.ok());
  EXPECT_EQ(sums->weight, std::vector<float>(kH, 1.0f)) << "refused backwards add nothing";
}

TEST(HeadGradientSteps, AClosedKeyIsRefused) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  ASSERT_TRUE(steps.Accumulate("s", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  ASSERT_TRUE(steps.Close("s").ok());
  EXPECT_TRUE(steps.Close("s").ok()) << "a retried close";
  EXPECT_EQ(steps.bytes(), 0);
  const absl::Status again = steps.Accumulate("s", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  EXPECT_NE(again.message().find("'s' was closed"), absl::string_view::npos) << again;
  EXPECT_EQ(steps.Read("s", 0, 1, t0).status().code(), absl::StatusCode::kAlreadyExists);
  // A key never opened here closes too, and is never used afterwards.
  EXPECT_TRUE(steps.Close("never").ok());
  EXPECT_EQ(steps.Read("never", 0, 0).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(HeadGradientSteps, TheBudgetHoldsAndClosingMakesRoom) {
  const int64_t step_bytes = kRows * kH * 4;
  HeadGradientSteps steps({2 * step_bytes, absl::Minutes(10)});
  ASSERT_TRUE(steps.Accumulate("a", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  ASSERT_TRUE(steps.Accumulate("b", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  const absl::Status full = steps.Accumulate("c", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(steps.Accumulate("a", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok())
      << "an open step still takes backwards";
  ASSERT_TRUE(steps.Close("a").ok());
  EXPECT_TRUE(steps.Accumulate("c", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  EXPECT_EQ(steps.bytes(), 2 * step_bytes);
}

TEST(HeadGradientSteps, IdleStepsExpireAndTheirKeysAreRefused) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  ASSERT_TRUE(steps.Accumulate("old", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  ASSERT_TRUE(steps.Accumulate("kept", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  ASSERT_TRUE(steps.Read("kept", 0, 1, t0 + absl::Minutes(8)).ok()) << "a read keeps a step alive";
  EXPECT_EQ(steps.Sweep(t0 + absl::Minutes(11)), 1);
  EXPECT_EQ(steps.open_steps(), 1u);
  const absl::Status lost =
      steps.Accumulate("old", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0 + absl::Minutes(11));
  EXPECT_EQ(lost.code(), absl::StatusCode::kFailedPrecondition) << lost;
  EXPECT_NE(lost.message().find("idle for more than 10m"), absl::string_view::npos) << lost;
}

TEST(HeadGradientSteps, AFailedAddDropsTheStep) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  ASSERT_TRUE(steps.Accumulate("s", "policy", "v1", kRows, kH, false, 1, AddValue(1.0f), t0).ok());
  const absl::Status failed = steps.Accumulate(
      "s", "policy", "v1", kRows, kH, false, 1, [](HeadGradientSums&) { return absl::InternalError("oneDNN failed"); },
      t0);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(steps.bytes(), 0);
  const absl::Status read = steps.Read("s", 0, 1, t0).status();
  EXPECT_EQ(read.code(), absl::StatusCode::kFailedPrecondition) << read;
  EXPECT_NE(read.message().find("oneDNN failed"), absl::string_view::npos) << read;
}

TEST(HeadGradientSteps, AnAddThatAddedNothingKeepsTheStep) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  ASSERT_TRUE(steps.Accumulate("s", "policy", "v1", kRows, kH, true, 4, AddValue(1.0f), t0).ok());
  const int64_t bytes = steps.bytes();
  const absl::Status refused = steps.Accumulate(
      "s", "policy", "v1", kRows, kH, true, 4,
      [](HeadGradientSums&) { return HeadGradientSteps::NothingAdded(absl::AbortedError("worker 2 refused")); }, t0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
  EXPECT_EQ(refused.message(), "worker 2 refused");
  EXPECT_EQ(steps.bytes(), bytes);
  EXPECT_EQ(steps.open_steps(), 1u);
  auto kept = steps.Read("s", 0, kRows, t0);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->micro_batches, 1) << "the refused backward is not counted";
  EXPECT_EQ(kept->tokens, 4);
  EXPECT_EQ(kept->weight, std::vector<float>(kRows * kH, 1.0f));
  EXPECT_EQ(kept->bias, std::vector<float>(kRows, 1.0f));
  // It still takes backwards; a plain error then drops it.
  ASSERT_TRUE(steps.Accumulate("s", "policy", "v1", kRows, kH, true, 4, AddValue(1.0f), t0).ok());
  EXPECT_EQ(steps.Read("s", 0, 1, t0)->micro_batches, 2);
  const absl::Status failed = steps.Accumulate(
      "s", "policy", "v1", kRows, kH, true, 4, [](HeadGradientSums&) { return absl::AbortedError("worker 2 refused"); },
      t0);
  EXPECT_EQ(failed.code(), absl::StatusCode::kAborted) << failed;
  EXPECT_EQ(steps.bytes(), 0);
  const absl::Status dropped = steps.Read("s", 0, 1, t0).status();
  EXPECT_EQ(dropped.code(), absl::StatusCode::kFailedPrecondition) << dropped;
  EXPECT_NE(dropped.message().find("worker 2 refused"), absl::string_view::npos) << dropped;
}

TEST(HeadGradientSteps, AStepOpenedByAnAddThatAddedNothingStaysOpenAndEmpty) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  const absl::Status refused = steps.Accumulate(
      "fresh", "policy", "v1", kRows, kH, false, 4,
      [](HeadGradientSums&) { return HeadGradientSteps::NothingAdded(absl::UnavailableError("peer went away")); }, t0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  auto sums = steps.Read("fresh", 0, kRows, t0);
  ASSERT_TRUE(sums.ok()) << sums.status();
  EXPECT_EQ(sums->micro_batches, 0);
  EXPECT_EQ(sums->tokens, 0);
  EXPECT_EQ(sums->weight, std::vector<float>(kRows * kH, 0.0f));
  EXPECT_EQ(sums->version, "v1") << "bound at opening";
}

TEST(HeadGradientSteps, AnEmptyReadSaysWhatTheStepCovers) {
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  ASSERT_TRUE(steps.Accumulate("b", "policy", "v1", kRows, kH, true, 3, AddValue(1.0f), t0).ok());
  ASSERT_TRUE(steps.Accumulate("nb", "policy", "v2", kRows, kH, false, 3, AddValue(1.0f), t0).ok());
  for (int64_t at : {int64_t{0}, int64_t{2}, kRows}) {
    auto with = steps.Read("b", at, at, t0);
    ASSERT_TRUE(with.ok()) << with.status();
    EXPECT_TRUE(with->has_bias);
    EXPECT_TRUE(with->weight.empty());
    EXPECT_TRUE(with->bias.empty());
    EXPECT_EQ(with->rows, kRows);
    EXPECT_EQ(with->hidden_size, kH);
    EXPECT_EQ(with->micro_batches, 1);
    EXPECT_EQ(with->tokens, 3);
    auto without = steps.Read("nb", at, at, t0);
    ASSERT_TRUE(without.ok()) << without.status();
    EXPECT_FALSE(without->has_bias);
    EXPECT_EQ(without->version, "v2");
  }
  EXPECT_EQ(steps.Read("b", 2, 1, t0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(steps.Read("b", -1, 0, t0).status().code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace logprob
