// Integration: the serving lifecycle under failure and load. Ports are
// exclusive: a second server on a busy API, metrics or control port exits
// 1 naming the port and its holder. A worker
// killed mid-request, deadlines, client cancellation, SIGTERM drain and
// overload against a bounded queue. The slow requests are hidden-states
// requests (a GEMM of T x 32000 x 1024), which take seconds on CPU; each
// step waits until /metrics shows the slow request running on the worker
// pool (logprob_running_batches), or health shows the server draining,
// never for a fixed time.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/health_check.h"
#include "common/channel.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kV = 32000, kH = 1024;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

class Lifecycle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { work_ = new HiddenWorkload("lifecycle", kV, kH, 3, 16384, 64); }
  static void TearDownTestSuite() { delete work_; }
  /// A server with the workload's lm_head and /metrics on metrics_port_.
  std::unique_ptr<ServerProcess> Start(int workers, std::vector<std::string> extra = {}) {
    extra.insert(extra.end(),
                 {"--lm-head", work_->lm_head, "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port_)});
    return ServerProcess::Start(workers, extra);
  }
  /// Waits until a batch (the slow request) runs on the worker pool.
  ::testing::AssertionResult WaitSlowRunning() const {
    return WaitForMetric(metrics_port_, "logprob_running_batches", 1);
  }
  /// A request that keeps the workers busy for seconds (built once).
  static const v1::ScoreRequest& Slow() { return work_->slow; }
  static const v1::ScoreRequest& Quick() { return work_->quick; }
  /// A stub whose channel is connected (a quick request went through).
  static std::unique_ptr<v1::LogprobService::Stub> ConnectedStub(const ServerProcess& server) {
    auto stub = server.NewStub();
    EXPECT_TRUE(Score(*stub, Quick()).ok());
    return stub;
  }

  static grpc::Status Score(v1::LogprobService::Stub& stub, const v1::ScoreRequest& req,
                            grpc::ClientContext* ctx = nullptr) {
    grpc::ClientContext local;
    v1::ScoreResponse resp;
    return stub.Score(ctx ? ctx : &local, req, &resp);
  }
  static HiddenWorkload* work_;
  const int metrics_port_ = FreePort();
};
HiddenWorkload* Lifecycle::work_ = nullptr;

TEST_F(Lifecycle, KilledWorkerFailsRequestsFastAndThePoolComesBack) {
  auto server = Start(2);
  ASSERT_TRUE(server);
  auto stub = ConnectedStub(*server);
  const auto before = server->WorkerPids();
  ASSERT_EQ(before.size(), 2u);
  auto slow = std::async(std::launch::async, [&] { return Score(*stub, Slow()); });
  ASSERT_TRUE(WaitSlowRunning());
  const auto killed_at = Clock::now();
  kill(before[1], SIGKILL);
  const grpc::Status st = slow.get();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  // Far below the workers' 60 s collective time-out, however loaded the machine.
  EXPECT_LT(SecondsSince(killed_at), 20.0) << "the failure must not wait for a collective time-out";
  // "being re-formed" (the calls were in flight) or "re-forming" (the pool
  // saw the worker exit a moment before the calls went out).
  EXPECT_NE(st.error_message().find("re-form"), std::string::npos) << st.error_message();

  // Health comes back and later requests succeed on new workers.
  const auto health = client::WaitForServing(client::MakeChannel(server->address()), std::chrono::seconds(60));
  ASSERT_TRUE(health.ok()) << health;
  const grpc::Status again = Score(*stub, Quick());
  EXPECT_TRUE(again.ok()) << again.error_message();
  const auto after = server->WorkerPids();
  EXPECT_EQ(after.size(), 2u);
  for (pid_t p : after) EXPECT_TRUE(p != before[0] && p != before[1]) << "worker " << p << " was not respawned";
  EXPECT_TRUE(server->Alive());
}

TEST_F(Lifecycle, DeadlineAndCancelStopTheWorkWithoutRestartingThePool) {
  auto server = Start(2);
  ASSERT_TRUE(server);
  auto stub = ConnectedStub(*server);
  const auto pids = server->WorkerPids();
  // This machine's pace right now: a quick request alone (32 hidden rows
  // per worker; a round of the slow request is 4 times that, all of it 256
  // times).
  auto t0 = Clock::now();
  ASSERT_TRUE(Score(*stub, Quick()).ok());
  const double quick_alone = SecondsSince(t0);

  grpc::ClientContext with_deadline;
  with_deadline.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(400));
  t0 = Clock::now();
  grpc::Status st = Score(*stub, Slow(), &with_deadline);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_LT(SecondsSince(t0), 2.0);

  // The expired request's batch has ended, so the gauge will show the next one.
  ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_running_batches", 0));
  grpc::ClientContext cancelled;
  t0 = Clock::now();
  auto slow = std::async(std::launch::async, [&] { return Score(*stub, Slow(), &cancelled); });
  ASSERT_TRUE(WaitSlowRunning());
  cancelled.TryCancel();
  st = slow.get();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();

  // The workers stopped at a chunk boundary: a quick request waits for at
  // most the round in progress, not for the rest of the slow one (several
  // seconds of GEMM). The bound scales with the machine's pace.
  t0 = Clock::now();
  st = Score(*stub, Quick());
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_LT(SecondsSince(t0), 1.5 + 20 * quick_alone) << "a quick request alone took " << quick_alone << " s";
  EXPECT_EQ(server->WorkerPids(), pids) << "a deadline or a cancel must not restart the pool";
}

/// Hidden-states requests (collectives on 2 workers) whose deadlines pass
/// around the moment their items go out to the workers, each followed by
/// a request that must come back as it did alone: a stopped item must end
/// on every rank at the same round, so that no rank pairs its collectives
/// with the next item's (a worker dying in Gloo, or the pool stalling).
TEST_F(Lifecycle, DeadlinesPassingAsItemsStartLeaveTheWorkersInStep) {
  auto server = Start(2);
  ASSERT_TRUE(server);
  auto stub = ConnectedStub(*server);
  const auto pids = server->WorkerPids();
  v1::ScoreResponse want;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Score(&ctx, Quick(), &want).ok());
  }
  int expired = 0;
  for (int i = 0; i < 60; ++i) {
    grpc::ClientContext short_lived;
    short_lived.set_deadline(std::chrono::system_clock::now() + std::chrono::microseconds(250 * (i % 40)));
    v1::ScoreResponse ignored;
    const grpc::Status st = stub->Score(&short_lived, Quick(), &ignored);
    if (!st.ok()) {
      ++expired;
      ASSERT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "round " << i << ": " << st.error_message();
    }
    grpc::ClientContext ctx;
    v1::ScoreResponse got;
    const grpc::Status again = stub->Score(&ctx, Quick(), &got);
    ASSERT_TRUE(again.ok()) << "round " << i << ": " << again.error_message();
    ASSERT_EQ(got.SerializeAsString(), want.SerializeAsString()) << "round " << i;
  }
  EXPECT_GT(expired, 0) << "no deadline passed: the test exercised nothing";
  EXPECT_EQ(server->WorkerPids(), pids) << "an expired request must not restart the pool";
}

TEST_F(Lifecycle, SigtermDrainsTheRequestsInFlight) {
  auto server = Start(1, {"--shutdown-grace", "60"});
  ASSERT_TRUE(server);
  auto stub = ConnectedStub(*server);
  auto slow = std::async(std::launch::async, [&] { return Score(*stub, Slow()); });
  ASSERT_TRUE(WaitSlowRunning());
  const std::string address = server->address();
  auto exit_code = std::async(std::launch::async, [&] { return server->SignalAndWait(SIGTERM); });
  // Draining: the server refuses new calls (a fresh connection's health
  // check fails with UNAVAILABLE, not just NOT_SERVING).
  ASSERT_TRUE(WaitUntil("the draining server to refuse new calls", [&] {
    const auto st =
        client::CheckHealth(client::MakeChannel(address), std::chrono::system_clock::now() + std::chrono::seconds(5));
    return st.status().code() == absl::StatusCode::kUnavailable;
  }));
  // No new requests once draining.
  grpc::ClientContext late;
  late.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::Status refused = Score(*stub, Quick(), &late);
  EXPECT_FALSE(refused.ok());
  const grpc::Status st = slow.get();
  EXPECT_TRUE(st.ok()) << "the request in flight must finish: " << st.error_message();
  EXPECT_EQ(exit_code.get(), 0);
}

/// The whole of file `path` ("" when it cannot be read).
std::string FileText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A drain that only drains: after SIGTERM a worker that leaves fails the
// request in flight (UNAVAILABLE, retryable) but the front-end forms no new
// pool; an idle ScoreStream keeps the drain open meanwhile, and once it
// ends the server exits 0. Checked from the server's log ("forming worker
// pool generation N" comes before any launch) and the process table.
TEST_F(Lifecycle, AWorkerLeavingDuringTheDrainStartsNoNewWorkers) {
  const std::string log = ::testing::TempDir() + "/drain_only." + std::to_string(getpid()) + ".log";
  std::remove(log.c_str());
  const std::vector<std::string> flags = {"--shutdown-grace", "120",
                                          "--lm-head",        work_->lm_head,
                                          "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port_)};
  auto server = ServerProcess::Start(
      2, flags, [](const std::string& address) { return client::MakeChannel(address); }, log);
  ASSERT_TRUE(server);
  auto stub = ConnectedStub(*server);
  const std::vector<pid_t> before = server->WorkerPids();
  ASSERT_EQ(before.size(), 2u);
  // An idle stream: a call in flight that keeps the drain open.
  grpc::ClientContext stream_ctx;
  auto stream = stub->ScoreStream(&stream_ctx);
  auto slow = std::async(std::launch::async, [&] { return Score(*stub, Slow()); });
  ASSERT_TRUE(WaitSlowRunning());
  const pid_t pid = server->pid();
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  ASSERT_TRUE(WaitUntil("the drain to start",
                        [&] { return FileText(log).find("SIGTERM: NOT_SERVING, draining") != std::string::npos; }));
  ASSERT_EQ(kill(before[1], SIGKILL), 0);
  ASSERT_TRUE(WaitUntil("the pool to see the worker gone",
                        [&] { return FileText(log).find("generation 0 failed") != std::string::npos; }));
  const grpc::Status st = slow.get();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  // Still draining (the stream is open): no worker but the survivor.
  for (const pid_t p : server->WorkerPids()) EXPECT_EQ(p, before[0]) << "a worker started during the drain";
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(server->SignalAndWait(0), 0) << "the drained server exits 0";
  const std::string text = FileText(log);
  EXPECT_NE(text.find("generation 0 failed"), std::string::npos) << text;
  EXPECT_NE(text.find("draining: not re-forming the pool"), std::string::npos) << text;
  EXPECT_EQ(text.find("forming worker pool generation 1"), std::string::npos) << text;
  EXPECT_EQ(text.find("of pool generation 1"), std::string::npos) << text;
  std::remove(log.c_str());
}

TEST_F(Lifecycle, OverloadGetsExactlyOneAnswerPerRequest) {
  auto server = Start(1, {"--max-queue-tokens", "3000"});
  ASSERT_TRUE(server);
  constexpr int kClients = 12;
  // One connected channel shared by all clients: the test is about
  // admission, not about 12 connection handshakes on a loaded machine.
  auto stub = ConnectedStub(*server);
  std::vector<std::future<grpc::Status>> answers;
  for (int i = 0; i < kClients; ++i)
    answers.push_back(
        std::async(std::launch::async, [&, i] { return Score(*stub, RandomHiddenRequest(1024, kH, kV, 100 + i)); }));
  int ok = 0, exhausted = 0;
  for (auto& a : answers) {
    const grpc::Status st = a.get();
    if (st.ok()) {
      ++ok;
    } else {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
      EXPECT_NE(st.error_message().find("retry"), std::string::npos) << st.error_message();
      ++exhausted;
    }
  }
  EXPECT_EQ(ok + exhausted, kClients);
  EXPECT_GE(ok, 1);
  EXPECT_GE(exhausted, 1) << "12 x 1023 tokens at once must exceed a 3000-token queue";
  EXPECT_TRUE(client::WaitForServing(client::MakeChannel(server->address()), std::chrono::seconds(5)).ok());
  EXPECT_TRUE(Score(*server->NewStub(), Quick()).ok());
}

// The server and its workers share one stderr: each line of the start-up
// log (and of the shutdown) is written whole (common/log_line.h), so the
// lines of four workers starting together never interleave.
TEST(ServerLog, WorkersStartUpLinesAreWhole) {
  const std::string log = ::testing::TempDir() + "/server_log." + std::to_string(getpid()) + ".txt";
  const std::string address = "127.0.0.1:" + std::to_string(FreePort());
  const CommandResult r = RunCommand(
      "set -e; " + BinDir() + "/logprob-server --listen " + address + " --workers 4 --backend cpu --lm-head " +
      GoldenDir() + "/hidden_bf16.lm_head.safetensors 2> " + log + " & pid=$!; " + BinDir() +
      "/logprob-client health --server " + address + " --wait 120; kill $pid; wait $pid");
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(log);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::remove(log.c_str());
  std::map<std::string, int> seen;
  for (const std::string& line : lines) {
    SCOPED_TRACE(line);
    // One program's prefix, once, at the start of the line.
    const bool server = line.rfind("logprob-server: ", 0) == 0, worker = line.rfind("logprob-worker: ", 0) == 0;
    EXPECT_TRUE(server || worker);
    EXPECT_EQ(line.find("logprob-server: ", 1), std::string::npos);  // no second line inside this one
    EXPECT_EQ(line.find("logprob-worker: ", 1), std::string::npos);
    for (int rank = 0; rank < 4; ++rank) {
      for (const std::string& what : {absl::StrCat("rank ", rank, "/4 of pool generation 0"),
                                      absl::StrCat("rank ", rank, " loaded lm_head default version initial: "),
                                      absl::StrCat("rank ", rank, " backend cpu, comm gloo"),
                                      absl::StrCat("rank ", rank, "/4 serving on 127.0.0.1:")}) {
        if (line.rfind("logprob-worker: " + what, 0) == 0) ++seen[what];
      }
    }
  }
  EXPECT_EQ(seen.size(), 16u) << absl::StrJoin(lines, "\n");
  // Issue 42: every worker was told the front-end's lm_head store folder,
  // the only one it writes staged update rows in.
  std::string store;
  for (const std::string& line : lines)
    if (line.rfind("logprob-server: lm_head store ", 0) == 0) store = line.substr(30);
  ASSERT_FALSE(store.empty()) << absl::StrJoin(lines, "\n");
  int told = 0;
  for (const std::string& line : lines)
    if (line.find(" backend cpu, comm gloo") != std::string::npos && absl::EndsWith(line, ", lm_head store " + store))
      ++told;
  EXPECT_EQ(told, 4) << absl::StrJoin(lines, "\n");
  for (const auto& [what, n] : seen) EXPECT_EQ(n, 1) << what;
}

// Two servers on one port: the second one must not share it (gRPC's
// default SO_REUSEPORT would let both listen and split new connections),
// for each port the server listens on. It exits 1 before starting any
// worker, naming the flag, the address and the process holding it.
TEST(ExclusivePorts, ASecondServerOnABusyPortExitsNamingIt) {
  const std::string metrics = "127.0.0.1:" + std::to_string(FreePort());
  const std::string control = "127.0.0.1:" + std::to_string(FreePort());
  auto first = ServerProcess::Start(1, {"--metrics-listen", metrics, "--control-listen", control});
  ASSERT_TRUE(first);
  const std::string holder = "(by pid " + std::to_string(first->pid()) + ", logprob-server";
  struct Case {
    std::string port, flags;
  };
  const std::vector<Case> cases = {
      {"--listen " + first->address(), " --listen " + first->address()},
      {"--metrics-listen " + metrics,
       " --listen 127.0.0.1:" + std::to_string(FreePort()) + " --metrics-listen " + metrics},
      {"--control-listen " + control,
       " --listen 127.0.0.1:" + std::to_string(FreePort()) + " --control-listen " + control},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.port);
    // `timeout`: a second server that starts anyway would serve forever.
    const CommandResult second =
        RunCommand("timeout 120 " + BinDir() + "/logprob-server --workers 1 --backend cpu" + c.flags + " 2>&1");
    EXPECT_EQ(second.code, 1) << second.output;
    EXPECT_NE(second.output.find("cannot listen on " + c.port + " is already in use " + holder), std::string::npos)
        << second.output;
    EXPECT_EQ(second.output.find("SERVING"), std::string::npos) << second.output;
  }
  // The first server keeps every port, and serves.
  EXPECT_TRUE(first->Alive());
  auto stub = first->NewStub();
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  EXPECT_EQ(ScrapeMetrics(std::stoi(metrics.substr(metrics.rfind(':') + 1))).code, 0);
}

}  // namespace
}  // namespace logprob::testing
