// Dynamic batching through a live server (server/batcher.h):
// - concurrent requests share worker batches (fewer batches than requests,
//   from /metrics), and every response is bitwise the one the same request
//   gets alone, for token-parallel, vocab-parallel and hidden-states
//   requests, and the golden cases still match their expected outputs;
// - the token budget keeps requests that do not fit apart;
// - a request whose deadline passes while it waits in the queue leaves it
//   with DEADLINE_EXCEEDED, and the server goes on serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int kWorkers = 2;

/// The output tensors of a response, serialized: equal strings mean
/// bitwise-equal outputs.
std::string OutputBytes(const v1::ScoreResponse& r) {
  std::string s;
  for (const auto& t : r.outputs()) s += t.SerializeAsString();
  return s;
}

struct Scored {
  grpc::Status status;
  v1::ScoreResponse response;
};

Scored ScoreOnce(v1::LogprobService::Stub& stub, const v1::ScoreRequest& req) {
  Scored s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  s.status = stub.Score(&ctx, req, &s.response);
  return s;
}

/// A labelled request, with the golden case it comes from (if any).
struct Case {
  std::string label;
  v1::ScoreRequest request;
  const GoldenCase* golden = nullptr;
};

TEST(Batching, ConcurrentRequestsShareBatchesAndMatchScoringAlone) {
  const int metrics_port = FreePort();
  auto server = ServerProcess::Start(kWorkers, {"--max-queue-delay", "150ms", "--lm-head",
                                                GoldenDir() + "/hidden_bf16.lm_head.safetensors", "--metrics-listen",
                                                "127.0.0.1:" + std::to_string(metrics_port)});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  int64_t vocab_size = 0;  // of the lm_head
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
    EXPECT_DOUBLE_EQ(info.max_queue_delay_seconds(), 0.15);
    EXPECT_EQ(info.max_batch_tokens(), 8192);
    vocab_size = info.vocab_size();
  }

  // Three copies of every golden case (same batch key within a case), random
  // packed logits of several lengths sharing options (token-parallel), single
  // rows (fewer rows than workers: vocab-parallel) and random hidden states.
  std::vector<GoldenCase> goldens;
  for (const std::string& name : LogitsGoldenNames()) goldens.push_back(LoadGolden(name));
  goldens.push_back(LoadGolden("hidden_bf16"));
  std::vector<Case> cases;
  for (const GoldenCase& g : goldens)
    for (int copy = 0; copy < 3; ++copy) cases.push_back({g.name + " copy " + std::to_string(copy), GoldenRequest(g), &g});
  uint32_t seed = 1;
  for (int64_t T : {3, 17, 64, 130, 2}) {
    v1::ScoreRequest r = RandomPackedRequest("logits", T, 5000, 5000, seed++);
    r.mutable_options()->set_topk(4);
    cases.push_back({"random logits T=" + std::to_string(T), r});
  }
  for (int i = 0; i < 3; ++i) cases.push_back({"one row", RandomPackedRequest("logits", 2, 3001, 3001, seed++)});
  const GoldenCase& hidden = goldens.back();
  const auto& hidden_shape = hidden.inputs.Find("hidden_states")->shape();
  const int64_t H = hidden_shape[hidden_shape.size() - 1];
  for (int64_t T : {5, 40})
    cases.push_back({"random hidden T=" + std::to_string(T), RandomHiddenRequest(T, H, vocab_size, seed++)});

  // Alone: one request at a time, so each batch holds one request.
  std::vector<std::string> alone;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    const Scored s = ScoreOnce(*stub, c.request);
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    alone.push_back(OutputBytes(s.response));
  }
  const CommandResult before = ScrapeMetrics(metrics_port);
  ASSERT_EQ(before.code, 0) << before.output;

  // Together: all at once.
  std::vector<std::future<Scored>> together;
  for (const Case& c : cases)
    together.push_back(std::async(std::launch::async, [&stub, &c] { return ScoreOnce(*stub, c.request); }));
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].label);
    const Scored s = together[i].get();
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_TRUE(OutputBytes(s.response) == alone[i]) << "batched result differs from the result alone";
    if (cases[i].golden) {
      const std::vector<v1::Tensor> got(s.response.outputs().begin(), s.response.outputs().end());
      EXPECT_EQ(CompareOutputs(cases[i].golden->expected.tensors, got), "");
    }
  }

  const CommandResult after = ScrapeMetrics(metrics_port);
  ASSERT_EQ(after.code, 0) << after.output;
  const double n = static_cast<double>(cases.size());
  const auto delta = [&](const std::string& series) {
    return MetricSample(after.output, series) - MetricSample(before.output, series);
  };
  EXPECT_EQ(MetricSample(before.output, "logprob_batch_requests_count"), n) << "alone, one request per batch";
  EXPECT_EQ(delta("logprob_batch_requests_sum"), n) << "every request is in exactly one batch";
  EXPECT_LT(delta("logprob_batch_requests_count"), n) << "concurrent requests must share batches";
  EXPECT_EQ(delta("logprob_queue_duration_seconds_count"), n);
  EXPECT_EQ(MetricSample(after.output, "logprob_queued_requests"), 0);
}

TEST(Batching, TokenBudgetSeparatesAndExpiredRequestsLeaveTheQueue) {
  const int metrics_port = FreePort();
  // A long delay: a request alone waits for company until the budget of 8
  // rows is full, so a small request with a short deadline expires queued.
  auto server = ServerProcess::Start(kWorkers, {"--max-queue-delay", "10s", "--max-batch-tokens", "8",
                                                "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port)});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const v1::ScoreRequest small = RandomPackedRequest("logits", 3, 1000, 1000, 7);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    v1::ScoreResponse resp;
    const auto t0 = std::chrono::steady_clock::now();
    const grpc::Status st = stub->Score(&ctx, small, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
    // Well before the 10 s delay ends: it left the queue at its deadline.
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 8);
  }
  // Requests of 8 rows fill the budget at once and run without waiting;
  // two of them never share a batch.
  const v1::ScoreRequest full_a = RandomPackedRequest("logits", 9, 1000, 1000, 8);  // 8 scored rows
  const v1::ScoreRequest full_b = RandomPackedRequest("logits", 9, 1000, 1000, 9);
  const Scored a_alone = ScoreOnce(*stub, full_a);
  ASSERT_TRUE(a_alone.status.ok()) << a_alone.status.error_message();
  auto fa = std::async(std::launch::async, [&] { return ScoreOnce(*stub, full_a); });
  auto fb = std::async(std::launch::async, [&] { return ScoreOnce(*stub, full_b); });
  const Scored a = fa.get(), b = fb.get();
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_TRUE(OutputBytes(a.response) == OutputBytes(a_alone.response));

  const CommandResult scrape = ScrapeMetrics(metrics_port);
  ASSERT_EQ(scrape.code, 0) << scrape.output;
  const std::string& m = scrape.output;
  EXPECT_EQ(MetricSample(m, R"(logprob_requests_total{code="DEADLINE_EXCEEDED",method="Score"})"), 1);
  EXPECT_EQ(MetricSample(m, "logprob_batch_requests_count"), 3) << "three full requests, three batches";
  EXPECT_EQ(MetricSample(m, "logprob_batch_requests_sum"), 3);
  EXPECT_EQ(MetricSample(m, "logprob_queued_requests"), 0);
  EXPECT_EQ(MetricSample(m, "logprob_inflight_requests"), 0);
}

}  // namespace
}  // namespace logprob::testing
