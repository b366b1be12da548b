// Dynamic batching through a live server (server/core/batcher.h):
// - requests that arrive while the workers are busy queue and then share
//   worker batches (far fewer batches than requests, from /metrics), and
//   every response is bitwise the one the same request gets alone, for
//   token-parallel, vocab-parallel and hidden-states requests; the golden
//   cases still match their expected outputs;
// - an idle pool starts a request at once (no queue delay);
// - the token budget keeps requests that do not fit apart;
// - a request whose deadline passes while it waits in the queue leaves it
//   with DEADLINE_EXCEEDED, and the server goes on serving;
// - the messages of one ScoreStream are scored concurrently, share batches
//   and are answered in order.
// Every "while the workers are busy" is observed, not timed: the tests wait
// until /metrics shows the slow request's batch running on the pool
// (logprob_running_batches) and the others queued (logprob_queued_requests).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int kWorkers = 2;
// The lm_head of the slow request that keeps the workers busy: its 32768
// hidden-states rows take seconds of GEMM (about 2 TFLOP).
constexpr int64_t kV = 32000, kH = 1024;

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

Scored ScoreOnce(v1::LogprobService::Stub& stub, const v1::ScoreRequest& req,
                 std::chrono::milliseconds deadline = std::chrono::seconds(300)) {
  Scored s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + deadline);
  s.status = stub.Score(&ctx, req, &s.response);
  return s;
}

/// A labelled request, with the golden case it comes from (if any).
struct Case {
  std::string label;
  v1::ScoreRequest request;
  const GoldenCase* golden = nullptr;
};

class Batching : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { work_ = new HiddenWorkload("batching", kV, kH, 5, 32768, 16); }
  static void TearDownTestSuite() {
    delete work_;
    work_ = nullptr;
  }
  /// A server holding the slow workload's lm_head, with a 10 s queue delay
  /// (the longest allowed) and /metrics on metrics_port_, plus `extra`
  /// flags.
  std::unique_ptr<ServerProcess> StartServer(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {"--max-queue-delay", "10s",
                                      "--lm-head",         work_->lm_head,
                                      "--metrics-listen",  "127.0.0.1:" + std::to_string(metrics_port_)};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return ServerProcess::Start(kWorkers, flags);
  }
  /// Starts the slow request and waits until its batch runs on the worker
  /// pool (its 67 MB may take a while to arrive on a loaded machine).
  std::future<Scored> StartSlow(v1::LogprobService::Stub& stub) {
    auto slow = std::async(std::launch::async, [&stub] { return ScoreOnce(stub, work_->slow); });
    EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_running_batches", 1)) << "the slow request never ran";
    return slow;
  }
  /// Waits until all `n` requests are in the queue at once, while only the
  /// slow request's batch runs: from then on, which requests share a batch
  /// no longer depends on timing (each key's oldest request takes all of
  /// its key's). Fails at once if a batch starts or the slow one ends
  /// before they have all queued.
  ::testing::AssertionResult WaitQueuedBehindSlow(int n) {
    double queued = -1, running = -1;
    auto r = WaitUntil(std::to_string(n) + " requests queued behind the running slow request", [&] {
      const CommandResult m = ScrapeMetrics(metrics_port_);
      if (m.code != 0) return false;
      queued = MetricSample(m.output, "logprob_queued_requests");
      running = MetricSample(m.output, "logprob_running_batches");
      return queued == n || running != 1;
    });
    if (r && queued != n)
      return ::testing::AssertionFailure() << "before all " << n << " requests had queued (" << queued
                                           << " queued), the running batches became " << running;
    return r;
  }
  static HiddenWorkload* work_;
  const int metrics_port_ = FreePort();
};
HiddenWorkload* Batching::work_ = nullptr;

TEST_F(Batching, QueuedRequestsShareBatchesAndMatchScoringAlone) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
    EXPECT_DOUBLE_EQ(info.max_queue_delay_seconds(), 10);
    EXPECT_EQ(info.max_batch_tokens(), 8192);
  }

  // Three copies of every logits golden case (same batch key within a
  // case), random packed logits of several lengths sharing options
  // (token-parallel), single rows (fewer rows than workers:
  // vocab-parallel) and random hidden states.
  std::vector<GoldenCase> goldens;
  for (const std::string& name : LogitsGoldenNames()) goldens.push_back(LoadGolden(name));
  std::vector<Case> cases;
  for (const GoldenCase& g : goldens)
    for (int copy = 0; copy < 3; ++copy)
      cases.push_back({g.name + " copy " + std::to_string(copy), GoldenRequest(g), &g});
  uint32_t seed = 1;
  for (int64_t T : {3, 17, 64, 130}) {
    v1::ScoreRequest r = RandomPackedRequest("logits", T, 5000, 5000, seed++);
    r.mutable_options()->set_topk(4);
    cases.push_back({"random logits T=" + std::to_string(T), r});
  }
  for (int i = 0; i < 3; ++i) cases.push_back({"one row", RandomPackedRequest("logits", 2, 3001, 3001, seed++)});
  for (int64_t T : {5, 40, 9}) {
    v1::ScoreRequest r = RandomHiddenRequest(T, kH, kV, seed++);
    if (T == 40) {  // log_sum_sq_probs, mean_logits and is_top1 from hidden states, batched too
      r.mutable_options()->set_log_sum_sq_probs(true);
      r.mutable_options()->set_mean_logits(true);
      r.mutable_options()->set_is_top1(true);
    }
    cases.push_back({"random hidden T=" + std::to_string(T), r});
  }

  // Alone: one request at a time. The pool is idle, so each starts at once
  // (the 10 s delay applies only while other batches run).
  std::vector<std::string> alone;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    const Scored s = ScoreOnce(*stub, c.request);
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    alone.push_back(OutputBytes(s.response));
  }
  const CommandResult before = ScrapeMetrics(metrics_port_);
  ASSERT_EQ(before.code, 0) << before.output;
  // The server's own queue times (not the wall time, which a busy machine
  // stretches): every request alone waited far less than the 10 s delay.
  EXPECT_EQ(MetricSample(before.output, R"(logprob_queue_duration_seconds_bucket{le="5"})"),
            MetricSample(before.output, "logprob_queue_duration_seconds_count"))
      << "an idle pool must not hold a request for the queue delay";

  // Busy: a slow request occupies the workers, everything else arrives
  // meanwhile, queues, and is batched by key when the workers free up.
  auto slow = StartSlow(*stub);
  std::vector<std::future<Scored>> together;
  for (const Case& c : cases)
    together.push_back(std::async(std::launch::async, [&stub, &c] { return ScoreOnce(*stub, c.request); }));
  EXPECT_TRUE(WaitQueuedBehindSlow(static_cast<int>(cases.size())));
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
  const Scored slow_done = slow.get();
  ASSERT_TRUE(slow_done.status.ok()) << slow_done.status.error_message();

  const CommandResult after = ScrapeMetrics(metrics_port_);
  ASSERT_EQ(after.code, 0) << after.output;
  const double n = static_cast<double>(cases.size());
  const auto delta = [&](const std::string& series) {
    return MetricSample(after.output, series) - MetricSample(before.output, series);
  };
  EXPECT_EQ(MetricSample(before.output, "logprob_batch_requests_count"), n) << "alone, one request per batch";
  EXPECT_EQ(delta("logprob_batch_requests_sum"), n + 1) << "every request (and the slow one) in exactly one batch";
  // 28 requests of 11 batch keys, plus the slow one's batch.
  EXPECT_LE(delta("logprob_batch_requests_count"), n / 2) << "queued requests must share batches";
  EXPECT_EQ(delta("logprob_queue_duration_seconds_count"), n + 1);
  EXPECT_EQ(MetricSample(after.output, "logprob_queued_requests"), 0);
}

TEST_F(Batching, TokenBudgetSeparatesAndExpiredRequestsLeaveTheQueue) {
  auto server = StartServer({"--max-batch-tokens", "8"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  // While the slow request runs, a small one with a short deadline waits
  // for company (the budget of 8 rows is not full) and expires queued.
  auto slow = StartSlow(*stub);
  {
    const v1::ScoreRequest small = RandomPackedRequest("logits", 3, 1000, 1000, 7);
    // 2 s: ample to reach the server on a loaded machine, far less than
    // the rest of the slow request's GEMM (about 2 TFLOP).
    const Scored s = ScoreOnce(*stub, small, std::chrono::seconds(2));
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.status.error_message();
  }
  // It left the queue at its deadline, before the 10 s delay would have
  // started its batch: no batch ever held it (batch count below), and the
  // queue is empty while the slow request still runs.
  EXPECT_TRUE(WaitUntil("the expired request to leave the queue", [&] {
    const CommandResult m = ScrapeMetrics(metrics_port_);
    return m.code == 0 && MetricSample(m.output, "logprob_queued_requests") == 0;
  }));
  EXPECT_EQ(slow.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the slow request must outlast the small one's queueing for this test to mean anything";
  const Scored slow_done = slow.get();
  ASSERT_TRUE(slow_done.status.ok()) << slow_done.status.error_message();

  // Requests of 8 rows fill the budget; two of them never share a batch.
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

  const CommandResult scrape = ScrapeMetrics(metrics_port_);
  ASSERT_EQ(scrape.code, 0) << scrape.output;
  const std::string& m = scrape.output;
  // The server saw the deadline pass (DEADLINE_EXCEEDED) or gRPC's deadline
  // timer cancel the call a moment before its clock reached the deadline
  // (CANCELLED): either way one request, which never reached a batch.
  const auto count = [&](const char* code) {
    return std::max(0.0,
                    MetricSample(m, std::string(R"(logprob_requests_total{code=")") + code + R"(",method="Score"})"));
  };
  EXPECT_EQ(count("DEADLINE_EXCEEDED") + count("CANCELLED"), 1);
  EXPECT_EQ(MetricSample(m, "logprob_batch_requests_count"), 4) << "the slow request and three full ones: four batches";
  EXPECT_EQ(MetricSample(m, "logprob_batch_requests_sum"), 4);
  EXPECT_EQ(MetricSample(m, "logprob_queued_requests"), 0);
  EXPECT_EQ(MetricSample(m, "logprob_inflight_requests"), 0);
}

TEST_F(Batching, StreamMessagesShareBatchesAndAnswerInOrder) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  constexpr int kMessages = 12;
  std::vector<v1::ScoreRequest> requests;
  std::vector<std::string> alone;
  for (int i = 0; i < kMessages; ++i) {
    v1::ScoreRequest r = RandomPackedRequest("logits", 5 + 3 * i, 4000, 4000, 100 + i);
    r.set_id("m" + std::to_string(i));
    const Scored s = ScoreOnce(*stub, r);
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    alone.push_back(OutputBytes(s.response));
    requests.push_back(std::move(r));
  }
  const CommandResult before = ScrapeMetrics(metrics_port_);
  ASSERT_EQ(before.code, 0) << before.output;

  // The workers are busy: every message of the stream queues, then they
  // share batches; answers come back in message order.
  auto slow = StartSlow(*stub);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  auto stream = stub->ScoreStream(&ctx);
  for (const auto& r : requests) ASSERT_TRUE(stream->Write(r));
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(WaitQueuedBehindSlow(kMessages));
  v1::ScoreResponse resp;
  for (int i = 0; i < kMessages; ++i) {
    SCOPED_TRACE("message " + std::to_string(i));
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.id(), "m" + std::to_string(i));
    EXPECT_EQ(resp.status_code(), 0) << resp.status_message();
    EXPECT_TRUE(OutputBytes(resp) == alone[i]) << "streamed and batched result differs from the result alone";
  }
  EXPECT_FALSE(stream->Read(&resp));
  const grpc::Status st = stream->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  ASSERT_TRUE(slow.get().status.ok());

  const CommandResult after = ScrapeMetrics(metrics_port_);
  ASSERT_EQ(after.code, 0) << after.output;
  const auto delta = [&](const std::string& series) {
    return MetricSample(after.output, series) - MetricSample(before.output, series);
  };
  EXPECT_EQ(delta("logprob_batch_requests_sum"), kMessages + 1);
  EXPECT_LE(delta("logprob_batch_requests_count"), kMessages / 2) << "the stream's messages must share batches";
  EXPECT_EQ(MetricSample(after.output, R"(logprob_requests_total{code="OK",method="ScoreStream"})"), kMessages);
}

}  // namespace
}  // namespace logprob::testing
