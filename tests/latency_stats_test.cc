// Percentiles of logprob-client bench against hand-computed values
// (linear interpolation between closest ranks, numpy.percentile's default).
#include "client/latency_stats.h"

#include <gtest/gtest.h>

namespace logprob::client {
namespace {

TEST(Percentile, InterpolatesBetweenClosestRanks) {
  const std::vector<double> v = {15, 20, 35, 40, 50};
  // Fractional index p / 100 * (n - 1) = p / 25.
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 15);
  EXPECT_DOUBLE_EQ(Percentile(v, 25), 20);    // index 1
  EXPECT_DOUBLE_EQ(Percentile(v, 40), 29);    // index 1.6: 20 + 0.6 * 15
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 35);    // index 2
  EXPECT_DOUBLE_EQ(Percentile(v, 90), 46);    // index 3.6: 40 + 0.6 * 10
  EXPECT_DOUBLE_EQ(Percentile(v, 99), 49.6);  // index 3.96: 40 + 0.96 * 10
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 50);
}

TEST(Percentile, SingleValueAndEmpty) {
  for (double p : {0.0, 50.0, 99.0, 100.0}) EXPECT_DOUBLE_EQ(Percentile({7}, p), 7);
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0);
}

TEST(Summarize, SortsAndSummarizes) {
  const LatencySummary s = Summarize({0.4, 0.1, 0.3, 0.2});
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 0.25);
  EXPECT_DOUBLE_EQ(s.min, 0.1);
  EXPECT_DOUBLE_EQ(s.max, 0.4);
  EXPECT_DOUBLE_EQ(s.p50, 0.25);   // index 1.5 of [0.1, 0.2, 0.3, 0.4]
  EXPECT_DOUBLE_EQ(s.p90, 0.37);   // index 2.7: 0.3 + 0.7 * 0.1
  EXPECT_DOUBLE_EQ(s.p99, 0.397);  // index 2.97
}

TEST(Summarize, EmptyIsAllZero) {
  const LatencySummary s = Summarize({});
  EXPECT_EQ(s.count, 0);
  EXPECT_EQ(s.p50, 0);
  EXPECT_EQ(s.max, 0);
}

}  // namespace
}  // namespace logprob::client
