// Integration: cluster mode. `logprob-server --external-workers 2` spawns
// nothing; the test starts the logprob-worker processes itself (as a
// Kubernetes StatefulSet would), checks that health waits for both, that
// golden cases score correctly, that a worker killed mid-request fails the
// request with UNAVAILABLE and health with NOT_SERVING, that the surviving
// worker re-joins by itself and a restarted worker is re-admitted, and that
// a spare worker waits and takes its place in the next generation. A
// worker host that stops answering (its link cut, the worker in a network
// namespace of its own) fails the request in flight with UNAVAILABLE
// within 5 s and re-joins when the link is back; a worker that only pauses
// briefly stays in the pool (common/keepalive.h). Each
// step waits for the state it needs, observed through health or /metrics
// (workers waiting to join, refused joins, batches running on the pool).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

#include "client/health_check.h"
#include "common/channel.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

using Clock = std::chrono::steady_clock;
using client::ServingStatus;
constexpr int64_t kV = 32000, kH = 1024;
constexpr auto kBound = std::chrono::seconds(90);  // generous: only prevents hangs

/// A logprob-worker started by the test, as a cluster's supervisor would
/// start it: `--frontend` only (rejoin on, the default). It also exits with
/// the test process, so a crashed test leaves no worker behind.
class WorkerProcess {
 public:
  explicit WorkerProcess(const std::string& frontend)
      : pid_(SpawnProcess({BinDir() + "/logprob-worker", "--frontend", frontend, "--internal-secret-file",
                           PoolSecretFile(), "--exit-with-parent"})) {}
  ~WorkerProcess() { Kill(); }
  /// SIGKILL and reap.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  /// A worker started as `prefix` + logprob-worker + `args` (e.g. in a
  /// network namespace: "ip netns exec NS").
  WorkerProcess(const std::vector<std::string>& prefix, const std::vector<std::string>& args) {
    std::vector<std::string> all = prefix;
    all.push_back(BinDir() + "/logprob-worker");
    all.insert(all.end(), args.begin(), args.end());
    all.insert(all.end(), {"--internal-secret-file", PoolSecretFile(), "--exit-with-parent"});
    pid_ = SpawnProcess(all);
  }
  /// True while the process has not exited (it re-executes in place when
  /// its generation ends, keeping its pid).
  bool Alive() const { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_;
};

/// Worker "hosts" on this machine: a network namespace per host, joined
/// by a veth pair to a bridge in this namespace (10.A.B.1/24; host i is
/// 10.A.B.(2 + i), A.B from this process's pid so parallel runs do not
/// meet). Cut(i) takes host i's link down: its packets are dropped, no
/// connection is closed, as when a machine or its network goes away.
/// Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.
class Hosts {
 public:
  /// The hosts, or null with the reason in *why.
  static std::unique_ptr<Hosts> Make(int n, std::string* why) {
    if (geteuid() != 0) {
      *why = "needs root to create network namespaces";
      return nullptr;
    }
    const CommandResult ip = RunCommand("command -v ip");
    if (ip.code != 0) {
      *why = "needs iproute2 (ip)";
      return nullptr;
    }
    auto h = std::unique_ptr<Hosts>(new Hosts);
    h->ip_ = ip.output.substr(0, ip.output.find('\n'));
    const int pid = getpid();
    h->tag_ = std::to_string(pid);
    h->subnet_ = "10." + std::to_string(200 + pid % 50) + "." + std::to_string(pid / 50 % 256) + ".";
    std::string cmd = "set -e; ip link add lpb" + h->tag_ + " type bridge; ip addr add " + h->subnet_ + "1/24 dev lpb" +
                      h->tag_ + "; ip link set lpb" + h->tag_ + " up";
    for (int i = 0; i < n; ++i) {
      const std::string ns = h->Namespace(i), host_end = h->HostEnd(i), w = "lpw" + h->tag_ + "-" + std::to_string(i);
      cmd += "; ip netns add " + ns + "; ip link add " + host_end + " type veth peer name " + w + "; ip link set " + w +
             " netns " + ns + "; ip link set " + host_end + " master lpb" + h->tag_ + "; ip link set " + host_end +
             " up; ip -n " + ns + " addr add " + h->address(i) + "/24 dev " + w + "; ip -n " + ns + " link set " + w +
             " up; ip -n " + ns + " link set lo up";
      h->n_ = i + 1;
    }
    const CommandResult made = RunCommand("(" + cmd + ") 2>&1");
    if (made.code != 0) {
      *why = "cannot create network namespaces here: " + made.output;
      return nullptr;  // the destructor removes what was made
    }
    return h;
  }
  ~Hosts() {
    std::string cmd = "ip link del lpb" + tag_;
    for (int i = 0; i < n_; ++i) cmd += "; ip netns del " + Namespace(i);
    RunCommand("(" + cmd + ") >/dev/null 2>&1");
  }
  /// This namespace's address on the bridge, and host i's.
  std::string bridge_address() const { return subnet_ + "1"; }
  std::string address(int i) const { return subnet_ + std::to_string(2 + i); }
  /// The command prefix that runs a program on host i.
  std::vector<std::string> On(int i) const { return {ip_, "netns", "exec", Namespace(i)}; }
  void Cut(int i) const { ASSERT_EQ(RunCommand("ip link set " + HostEnd(i) + " down 2>&1").code, 0); }
  void Restore(int i) const { ASSERT_EQ(RunCommand("ip link set " + HostEnd(i) + " up 2>&1").code, 0); }

 private:
  Hosts() = default;
  std::string Namespace(int i) const { return "lp" + tag_ + "-" + std::to_string(i); }
  std::string HostEnd(int i) const { return "lph" + tag_ + "-" + std::to_string(i); }
  std::string ip_, tag_, subnet_;
  int n_ = 0;
};

class Cluster : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { work_ = new HiddenWorkload("cluster", kV, kH, 5, 8192, 64); }
  static void TearDownTestSuite() { delete work_; }

  /// Starts `logprob-server --external-workers 2` on a fixed control port
  /// of `host` (frontend_), /metrics on metrics_port_, and waits until its
  /// health answers (NOT_SERVING).
  void StartServer(const std::string& host = "127.0.0.1") {
    frontend_ = host + ":" + std::to_string(FreePort());
    server_ = ServerProcess::Launch({"--external-workers", "2", "--control-listen", frontend_, "--backend", "cpu",
                                     "--internal-secret-file", PoolSecretFile(), "--lm-head", work_->lm_head,
                                     "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port_)});
    ASSERT_TRUE(server_);
    ASSERT_EQ(WaitForStatus(ServingStatus::kNotServing), ServingStatus::kNotServing);
    stub_ = server_->NewStub();
  }

  /// Polls health until it reports `want` or kBound passes; returns the
  /// last status seen (kUnknown while the server does not answer).
  ServingStatus WaitForStatus(ServingStatus want) const {
    auto channel = client::MakeChannel(server_->address());
    ServingStatus last = ServingStatus::kUnknown;
    WaitUntil(
        "health " + client::ServingStatusName(want),
        [&] {
          auto st = client::CheckHealth(channel, std::chrono::system_clock::now() + std::chrono::seconds(2));
          if (st.ok()) last = *st;
          return last == want;
        },
        kBound);
    return last;
  }
  /// Health right now (one call).
  ServingStatus Health() const {
    auto st = client::CheckHealth(client::MakeChannel(server_->address()),
                                  std::chrono::system_clock::now() + std::chrono::seconds(5));
    return st.ok() ? *st : ServingStatus::kUnknown;
  }

  grpc::Status Score(const v1::ScoreRequest& req, v1::ScoreResponse* resp = nullptr) const {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kBound);
    v1::ScoreResponse local;
    return stub_->Score(&ctx, req, resp ? resp : &local);
  }

  /// Scores every logits golden case and checks each against its
  /// expected outputs (docs/SPEC.md tolerance).
  void ExpectGoldenCasesPass() const {
    for (const auto& name : LogitsGoldenNames()) {
      SCOPED_TRACE(name);
      const GoldenCase c = LoadGolden(name);
      v1::ScoreResponse resp;
      const grpc::Status st = Score(GoldenRequest(c), &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      const std::vector<v1::Tensor> got(resp.outputs().begin(), resp.outputs().end());
      EXPECT_EQ(CompareOutputs(c.expected.tensors, got), "");
    }
    const grpc::Status hidden = Score(work_->quick);
    EXPECT_TRUE(hidden.ok()) << "hidden states: " << hidden.error_message();
  }

  /// A request that keeps both workers busy for seconds (hidden states,
  /// a GEMM of 8192 x 32000 x 1024).
  static const v1::ScoreRequest& Slow() { return work_->slow; }

  std::string frontend_;
  const int metrics_port_ = FreePort();
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::LogprobService::Stub> stub_;
  static HiddenWorkload* work_;
};
HiddenWorkload* Cluster::work_ = nullptr;

TEST_F(Cluster, WorkersJoinScoreAndARestartedWorkerIsReadmitted) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  const GoldenCase golden = LoadGolden("llama_vocab_bf16");
  grpc::Status st = Score(GoldenRequest(golden));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << "no worker has joined: " << st.error_message();

  // A worker that joins early waits for the second one.
  auto first = std::make_unique<WorkerProcess>(frontend_);
  ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_workers_waiting", 1)) << "the first worker did not join";
  EXPECT_EQ(Health(), ServingStatus::kNotServing) << "one of two workers must not be enough";
  EXPECT_TRUE(first->Alive());
  auto second = std::make_unique<WorkerProcess>(frontend_);
  ASSERT_EQ(WaitForStatus(ServingStatus::kServing), ServingStatus::kServing);
  ExpectGoldenCasesPass();

  // Kill the second worker mid-request: the request fails with
  // UNAVAILABLE, health goes NOT_SERVING and stays there (one worker left).
  auto slow = std::async(std::launch::async, [&] { return Score(Slow()); });
  ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_running_batches", 1)) << "the slow request never ran";
  second->Kill();
  ASSERT_EQ(slow.wait_for(kBound), std::future_status::ready) << "the request in flight must be answered";
  st = slow.get();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_EQ(WaitForStatus(ServingStatus::kNotServing), ServingStatus::kNotServing);
  st = Score(GoldenRequest(golden));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_workers_waiting", 1)) << "the survivor did not re-join";
  EXPECT_EQ(Health(), ServingStatus::kNotServing) << "the survivor alone must not form a pool of two";
  EXPECT_TRUE(first->Alive()) << "the survivor re-joins in place instead of exiting";

  // A restarted worker is re-admitted: SERVING again, golden cases pass.
  auto restarted = std::make_unique<WorkerProcess>(frontend_);
  ASSERT_EQ(WaitForStatus(ServingStatus::kServing), ServingStatus::kServing);
  ExpectGoldenCasesPass();
  EXPECT_TRUE(first->Alive());
  EXPECT_TRUE(restarted->Alive());
  EXPECT_TRUE(server_->Alive());
}

TEST_F(Cluster, ASpareWorkerWaitsAndTakesTheNextGeneration) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto a = std::make_unique<WorkerProcess>(frontend_);
  auto b = std::make_unique<WorkerProcess>(frontend_);
  ASSERT_EQ(WaitForStatus(ServingStatus::kServing), ServingStatus::kServing);
  // A third worker finds the pool full: it waits (retrying) and disturbs nothing.
  auto spare = std::make_unique<WorkerProcess>(frontend_);
  ASSERT_TRUE(WaitUntil("the spare worker's join to be refused", [&] {
    const CommandResult m = ScrapeMetrics(metrics_port_);
    return m.code == 0 && MetricSample(m.output, "logprob_worker_joins_refused_total") >= 1;
  }));
  EXPECT_EQ(Health(), ServingStatus::kServing);
  EXPECT_TRUE(spare->Alive());
  ExpectGoldenCasesPass();

  // When a member dies, the spare and the survivor form the next
  // generation. Until then requests get UNAVAILABLE; a request that
  // succeeds needs every worker of its generation, so it shows that the
  // pool is whole again without the killed one.
  a->Kill();
  const GoldenCase golden = LoadGolden("basic_f32");
  grpc::Status st;
  EXPECT_TRUE(WaitUntil(
      "a request to succeed on the next generation",
      [&] {
        st = Score(GoldenRequest(golden));
        if (!st.ok()) {
          EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
        }
        return st.ok();
      },
      kBound));
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(Health(), ServingStatus::kServing);
  ExpectGoldenCasesPass();
  EXPECT_TRUE(b->Alive());
  EXPECT_TRUE(spare->Alive());
}

// A worker host that stops answering (its link cut: packets dropped, no
// connection closed) fails the request in flight with UNAVAILABLE within
// 5 s (keepalive: a ping every 1 s, 2.5 s to answer) and takes health to
// NOT_SERVING; when the link is back the worker re-joins by itself and
// the pool serves again. The workers run in network namespaces of their
// own; skipped where they cannot be made.
TEST_F(Cluster, AWorkerHostThatStopsAnsweringFailsRequestsWithinSeconds) {
  std::string why;
  auto hosts = Hosts::Make(2, &why);
  if (!hosts) GTEST_SKIP() << why;
  ASSERT_NO_FATAL_FAILURE(StartServer(hosts->bridge_address()));
  std::vector<std::unique_ptr<WorkerProcess>> workers;
  for (int i = 0; i < 2; ++i)
    workers.push_back(std::make_unique<WorkerProcess>(
        hosts->On(i), std::vector<std::string>{"--frontend", frontend_, "--advertise-host", hosts->address(i)}));
  ASSERT_EQ(WaitForStatus(ServingStatus::kServing), ServingStatus::kServing);
  ASSERT_TRUE(Score(work_->quick).ok());

  Clock::time_point answered;
  auto slow = std::async(std::launch::async, [&] {
    grpc::Status st = Score(Slow());
    answered = Clock::now();
    return st;
  });
  ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_running_batches", 1)) << "the slow request never ran";
  const Clock::time_point cut = Clock::now();
  hosts->Cut(1);
  ASSERT_EQ(slow.wait_for(kBound), std::future_status::ready) << "the request in flight must be answered";
  const grpc::Status st = slow.get();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  const double seconds = std::chrono::duration<double>(answered - cut).count();
  EXPECT_LT(seconds, 5.0) << "the lost host must be noticed in seconds";
  EXPECT_EQ(Health(), ServingStatus::kNotServing);
  std::cerr << "host loss: the request in flight was answered " << seconds << " s after the link was cut" << std::endl;

  // The link is back: the cut worker (which lost its Join stream too)
  // re-joins, the other one re-joined already; SERVING again.
  hosts->Restore(1);
  ASSERT_EQ(WaitForStatus(ServingStatus::kServing), ServingStatus::kServing);
  ExpectGoldenCasesPass();
  for (const auto& w : workers) EXPECT_TRUE(w->Alive());
}

// A worker that pauses for a moment (stopped for 1 s: a stall well under
// the 2.5 s keepalive timeout) while a request runs stays in the pool: the
// request succeeds and the pool does not re-form. Loopback workers, no
// namespaces needed.
TEST_F(Cluster, AWorkerPausedBrieflyStaysInThePool) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto a = std::make_unique<WorkerProcess>(frontend_);
  auto b = std::make_unique<WorkerProcess>(frontend_);
  ASSERT_EQ(WaitForStatus(ServingStatus::kServing), ServingStatus::kServing);
  const double restarts = MetricSample(ScrapeMetrics(metrics_port_).output, "logprob_worker_restarts_total");
  auto slow = std::async(std::launch::async, [&] { return Score(Slow()); });
  ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_running_batches", 1)) << "the slow request never ran";
  ASSERT_EQ(kill(b->pid(), SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::seconds(1));  // the pause under test, not a wait for a state
  ASSERT_EQ(kill(b->pid(), SIGCONT), 0);
  const grpc::Status st = slow.get();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(Health(), ServingStatus::kServing);
  EXPECT_EQ(MetricSample(ScrapeMetrics(metrics_port_).output, "logprob_worker_restarts_total"), restarts)
      << "a brief pause must not re-form the pool";
  ExpectGoldenCasesPass();
}

TEST(ClusterFlags, BadCombinationsAreClearErrors) {
  const std::string server =
      "timeout 30 " + BinDir() + "/logprob-server --listen 127.0.0.1:" + std::to_string(FreePort()) + " ";
  auto r =
      RunCommand(server + "--external-workers 2 --workers 2 --control-listen 127.0.0.1:" + std::to_string(FreePort()));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--workers and --external-workers are mutually exclusive"), std::string::npos) << r.output;

  r = RunCommand(server + "--external-workers 2");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--external-workers needs --control-listen HOST:PORT with a fixed port"), std::string::npos)
      << r.output;

  r = RunCommand(server + "--external-workers -1");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--external-workers must be >= 1"), std::string::npos) << r.output;

  r = RunCommand("timeout 30 " + BinDir() + "/logprob-worker --frontend 127.0.0.1:1 --listen-host 0.0.0.0");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--advertise-host must be an address"), std::string::npos) << r.output;

  r = RunCommand("timeout 30 " + BinDir() + "/logprob-worker");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--frontend is required"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace logprob::testing
