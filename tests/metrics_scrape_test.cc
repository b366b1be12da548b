// Parsing of histogram totals from Prometheus text (logprob-client bench
// --metrics-url) and the URL errors of HttpGet.
#include "client/metrics_scrape.h"

#include <gtest/gtest.h>

namespace logprob::client {
namespace {

constexpr char kText[] = R"(# HELP logprob_request_duration_seconds Time from receiving a request to its answer.
# TYPE logprob_request_duration_seconds histogram
logprob_request_duration_seconds_count{method="Score"} 12
logprob_request_duration_seconds_sum{method="Score"} 3.5
logprob_request_duration_seconds_bucket{method="Score",le="0.001"} 0
logprob_request_duration_seconds_count{method="ScoreStream"} 4
logprob_request_duration_seconds_sum{method="ScoreStream"} 1.25
logprob_compute_duration_seconds_count 16
logprob_compute_duration_seconds_sum 2.5e-1
logprob_compute_duration_seconds_sum_other 99
)";

TEST(ParseHistogramTotals, AddsMatchingSeries) {
  const HistogramTotals score = ParseHistogramTotals(kText, "logprob_request_duration_seconds", "method=\"Score\"");
  EXPECT_DOUBLE_EQ(score.count, 12);
  EXPECT_DOUBLE_EQ(score.sum, 3.5);
  const HistogramTotals all = ParseHistogramTotals(kText, "logprob_request_duration_seconds");
  EXPECT_DOUBLE_EQ(all.count, 16);
  EXPECT_DOUBLE_EQ(all.sum, 4.75);
  const HistogramTotals compute = ParseHistogramTotals(kText, "logprob_compute_duration_seconds");
  EXPECT_DOUBLE_EQ(compute.count, 16);
  EXPECT_DOUBLE_EQ(compute.sum, 0.25);
  const HistogramTotals missing = ParseHistogramTotals(kText, "logprob_worker_call_duration_seconds");
  EXPECT_EQ(missing.count, 0);
  EXPECT_EQ(missing.sum, 0);
}

TEST(HttpGet, MalformedUrlNamesTheFlag) {
  for (const char* url : {"ftp://127.0.0.1:1/metrics", "http://127.0.0.1/metrics", "http://:80"}) {
    const auto r = HttpGet(url);
    ASSERT_FALSE(r.ok()) << url;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << url;
    EXPECT_NE(r.status().message().find("--metrics-url"), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace logprob::client
