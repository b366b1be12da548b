// Prometheus metrics of a live server: after a few OK requests and one
// INVALID_ARGUMENT, /metrics reports exactly those counts, the scored
// token positions, the worker count and one observation per OK request in
// each dispatch histogram; `promtool check metrics` accepts the scrape.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int kWorkers = 2;

double Sample(const std::string& scrape, const std::string& series) { return MetricSample(scrape, series); }

/// Element count of the expected token_logprobs of a golden case: the
/// token positions it scores.
int64_t ScoredPositions(const GoldenCase& c) {
  const v1::Tensor* lp = c.expected.Find("token_logprobs");
  if (lp == nullptr) return -1;
  int64_t n = 1;
  for (int64_t d : lp->shape()) n *= d;
  return n;
}

TEST(ServerMetrics, ScrapeReportsRequestsAndPassesPromtool) {
  const int metrics_port = FreePort();
  auto server = ServerProcess::Start(kWorkers, {"--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port)});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();

  int ok_requests = 0;
  int64_t scored = 0;
  for (const char* name : {"basic_f32", "sampling_f32", "basic_f32"}) {
    SCOPED_TRACE(name);
    const GoldenCase c = LoadGolden(name);
    v1::ScoreResponse resp;
    const grpc::Status st = ScoreGolden(*stub, c, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ++ok_requests;
    ASSERT_GT(ScoredPositions(c), 0);
    scored += ScoredPositions(c);
  }
  {
    v1::ScoreRequest bad = GoldenRequest(LoadGolden("basic_f32"));
    for (auto& t : *bad.mutable_inputs())
      if (t.name() == "logits") t.mutable_data()->resize(100);  // data size does not match the shape
    grpc::ClientContext ctx;
    v1::ScoreResponse resp;
    ASSERT_EQ(stub->Score(&ctx, bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }

  const CommandResult scrape = ScrapeMetrics(metrics_port);
  ASSERT_EQ(scrape.code, 0) << scrape.output;
  const std::string& m = scrape.output;
  SCOPED_TRACE(m);

  EXPECT_EQ(Sample(m, R"(logprob_requests_total{code="OK",method="Score"})"), ok_requests);
  EXPECT_EQ(Sample(m, R"(logprob_requests_total{code="INVALID_ARGUMENT",method="Score"})"), 1);
  EXPECT_EQ(Sample(m, R"(logprob_request_duration_seconds_count{method="Score"})"), ok_requests + 1);
  EXPECT_EQ(Sample(m, "logprob_tokens_scored_total"), scored);
  EXPECT_EQ(Sample(m, "logprob_workers_up"), kWorkers);
  EXPECT_EQ(Sample(m, "logprob_worker_restarts_total"), 0);
  EXPECT_EQ(Sample(m, absl::StrCat(R"(logprob_build_info{backend="cpu",version=")", kVersion, R"("})")), 1);
  // Every received request is sized, the bad one included.
  EXPECT_EQ(Sample(m, R"(logprob_request_bytes_count{method="Score"})"), ok_requests + 1);
  EXPECT_GT(Sample(m, R"(logprob_request_bytes_sum{method="Score"})"), 0);
  // Nothing is in flight once every answer has arrived.
  EXPECT_EQ(Sample(m, "logprob_inflight_requests"), 0);
  EXPECT_EQ(Sample(m, "logprob_queued_tokens"), 0);
  // One dispatch per OK request; the bad one never reached the workers.
  EXPECT_EQ(Sample(m, "logprob_compute_duration_seconds_count"), ok_requests);
  EXPECT_EQ(Sample(m, "logprob_worker_call_duration_seconds_count"), ok_requests);
  EXPECT_EQ(Sample(m, "logprob_batch_tokens_count"), ok_requests);
  EXPECT_EQ(Sample(m, "logprob_batch_tokens_sum"), scored);
  EXPECT_GT(Sample(m, "logprob_worker_call_duration_seconds_sum"), 0);
  EXPECT_GE(Sample(m, "logprob_worker_call_duration_seconds_sum"), Sample(m, "logprob_compute_duration_seconds_sum"));
  // Sequential requests: every batch holds one request, and each waited in the queue once.
  EXPECT_EQ(Sample(m, "logprob_batch_requests_count"), ok_requests);
  EXPECT_EQ(Sample(m, "logprob_batch_requests_sum"), ok_requests);
  EXPECT_EQ(Sample(m, "logprob_queue_duration_seconds_count"), ok_requests);
  EXPECT_EQ(Sample(m, "logprob_collective_duration_seconds_count"), ok_requests);
  EXPECT_EQ(Sample(m, "logprob_queued_requests"), 0);
  EXPECT_EQ(Sample(m, "logprob_running_batches"), 0);
  // Both local workers joined and got their ranks; nobody was refused.
  EXPECT_EQ(Sample(m, "logprob_workers_waiting"), 0);
  EXPECT_EQ(Sample(m, "logprob_worker_joins_refused_total"), 0);
  // Memory: the bound is the one `--print-memory-bound` gives for the same
  // flags, the process is within it, the pools within their caps.
  const CommandResult bound =
      RunCommand(BinDir() + "/logprob-server --print-memory-bound --workers " + std::to_string(kWorkers));
  ASSERT_EQ(bound.code, 0) << bound.output;
  ASSERT_EQ(bound.output.rfind("frontend_bytes=", 0), 0u) << bound.output;
  const double bound_bytes = std::strtod(bound.output.c_str() + std::string("frontend_bytes=").size(), nullptr);
  EXPECT_GT(bound_bytes, 1 << 30);
  EXPECT_EQ(Sample(m, "logprob_memory_bound_bytes"), bound_bytes);
  EXPECT_GT(Sample(m, "process_resident_memory_bytes"), 0);
  EXPECT_LT(Sample(m, "process_resident_memory_bytes"), bound_bytes);
  EXPECT_GE(Sample(m, "logprob_kept_freed_bytes"), 0);
  EXPECT_EQ(Sample(m, R"(logprob_pooled_bytes{pool="chunk_buffers"})"), 0);  // no ScoreChunked request came
  const double payload_idle = Sample(m, R"(logprob_pooled_bytes{pool="payload_regions"})");
  EXPECT_GE(payload_idle, 0);
  EXPECT_LE(payload_idle, 1 << 30);  // the pool's cap with --max-request-bytes 1 GiB

  // promtool (Debian package `prometheus`) lints the exposition format.
  if (RunCommand("command -v promtool").code != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus); skipping `promtool check metrics`";
  }
  const std::string file = ::testing::TempDir() + "server_metrics_test.prom";
  std::ofstream(file) << m;
  const CommandResult lint = RunCommand("promtool check metrics < " + file);
  std::remove(file.c_str());
  EXPECT_EQ(lint.code, 0) << lint.output;
  EXPECT_EQ(lint.output, "") << "promtool warnings:\n" << lint.output;
}

}  // namespace
}  // namespace logprob::testing
