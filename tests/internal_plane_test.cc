// The internal plane refuses everyone outside the pool (docs/security.md
// "The internal plane"): on a live server with two local workers, every
// method of every internal service declared in the protos, called on
// every port the server's process tree listens on beyond the public and
// metrics ports, without the pool secret and with a wrong one, by another
// process (under another uid where the test runs as root), is refused;
// the forged Ready of the next generation, the lone VOCAB_PARALLEL Run
// (the hijack) and the Run naming a client's shared-memory region (the
// region read) among them. The pool is untouched afterwards: the same
// worker processes, no restart, the same scores bit for bit. Cluster
// mode: workers join with the front-end's secret file; a worker without
// it is refused and exits saying why; a front-end beyond loopback without
// a secret, or with a secret file other users can read, refuses to start;
// --insecure-internal-plane says so in the log at start; a worker listening
// beyond loopback without a secret is refused whatever it advertises.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "logprob/internal/v1/worker.pb.h"
#include "tests/generic_call.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int64_t kV = 8192, kH = 256;  // the golden hidden_bf16 head

std::string LmHead() { return GoldenDir() + "/hidden_bf16.lm_head.safetensors"; }

/// The outputs' bytes of `req` scored on `stub` (fails the test on error).
std::vector<std::string> ScoreBytes(v1::LogprobService::Stub& stub, const v1::ScoreRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::ScoreResponse resp;
  const grpc::Status st = stub.Score(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  std::vector<std::string> out;
  for (const auto& t : resp.outputs()) out.push_back(t.name() + ":" + t.data());
  return out;
}

/// One probe line: port, method (or "-" for a port that is not gRPC), code.
struct ProbeCall {
  int port;
  std::string method;
  int code;
};

/// Runs tests/internal_plane_probe against `ports` of 127.0.0.1 with
/// `extra` flags, as uid nobody when this test runs as root (setpriv), so
/// the caller is a process that never saw the secret, of another user.
std::vector<ProbeCall> Probe(const std::vector<int>& ports, const std::string& extra, std::string* output) {
  std::string cmd = BinDir() + "/internal_plane_probe " + extra;
  for (const int p : ports) cmd += " 127.0.0.1:" + std::to_string(p);
  if (geteuid() == 0 && RunCommand("command -v setpriv").code == 0)
    cmd = "setpriv --reuid=65534 --regid=65534 --clear-groups " + cmd;
  const CommandResult r = RunCommand(cmd + " 2>&1");
  *output = r.output;
  EXPECT_EQ(r.code, 0) << r.output;
  std::vector<ProbeCall> calls;
  std::istringstream in(r.output);
  ProbeCall c;
  std::string rest;
  while (in >> c.port >> c.method) {
    if (c.method == "-") in >> rest;  // "not-grpc"
    in >> c.code;
    calls.push_back(c);
  }
  return calls;
}

/// Checks that every call was refused: on a gRPC port, each method
/// UNAUTHENTICATED (or UNIMPLEMENTED: the service is not served on that
/// port); at least `grpc_ports` ports answered gRPC and every method of
/// both services was called on each. Returns the gRPC ports.
std::set<int> ExpectAllRefused(const std::vector<ProbeCall>& calls, size_t grpc_ports, const std::string& output) {
  std::set<int> grpc;
  std::map<int, int> unauthenticated;
  for (const ProbeCall& c : calls) {
    if (c.method == "-") continue;
    grpc.insert(c.port);
    EXPECT_TRUE(c.code == static_cast<int>(grpc::StatusCode::UNAUTHENTICATED) ||
                c.code == static_cast<int>(grpc::StatusCode::UNIMPLEMENTED))
        << "port " << c.port << " " << c.method << " answered code " << c.code << "\n"
        << output;
    if (c.code == static_cast<int>(grpc::StatusCode::UNAUTHENTICATED)) ++unauthenticated[c.port];
  }
  EXPECT_GE(grpc.size(), grpc_ports) << output;
  for (const int p : grpc) {
    // Every Control and Worker method (the probe takes them from the same
    // descriptors) + the region Run: one call each a port.
    const auto* file = internal::v1::WorkItem::descriptor()->file();
    const int methods =
        file->FindServiceByName("Control")->method_count() + file->FindServiceByName("Worker")->method_count();
    int n = 0;
    for (const ProbeCall& c : calls) n += c.port == p;
    EXPECT_EQ(n, methods + 1) << "port " << p << "\n" << output;
    EXPECT_GE(unauthenticated[p], 5) << "port " << p << " refused too few methods as UNAUTHENTICATED\n" << output;
  }
  return grpc;
}

TEST(InternalPlane, EveryInternalMethodOnEveryPortRefusesCallersWithoutThePoolSecret) {
  const int metrics_port = FreePort();
  auto server =
      ServerProcess::Start(2, {"--lm-head", LmHead(), "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port)});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const v1::ScoreRequest req = RandomHiddenRequest(96, kH, kV, 42);
  const std::vector<std::string> before = ScoreBytes(*stub, req);
  const std::vector<pid_t> workers = server->WorkerPids();
  ASSERT_EQ(workers.size(), 2u);
  // Another client's region, as the attack read it (mode 0600, this uid).
  auto region = SharedRegion::Create(4096, "/logprob-client-" + std::to_string(getpid()) + "-victim");
  ASSERT_TRUE(region.ok()) << region.status();
  std::memcpy((*region)->data(), "hidden states of another client", 31);

  std::vector<pid_t> tree = workers;
  tree.push_back(server->pid());
  std::vector<int> ports = ListeningPorts(tree);
  const int public_port = std::stoi(server->address().substr(server->address().rfind(':') + 1));
  ports.erase(std::remove_if(ports.begin(), ports.end(), [&](int p) { return p == public_port || p == metrics_port; }),
              ports.end());
  // The control port and the two workers' ports at least (Gloo's too).
  ASSERT_GE(ports.size(), 3u);

  for (const std::string& extra : {std::string(""), std::string("--secret=not-the-pool-secret-0123456789")}) {
    SCOPED_TRACE(extra.empty() ? "no secret" : "a wrong secret");
    std::string output;
    const std::vector<ProbeCall> calls = Probe(ports, extra + " --region=" + (*region)->name(), &output);
    ExpectAllRefused(calls, 3, output);
  }
  // A large message from a caller without the secret is refused before a
  // worker reads it: the worker's peak memory does not grow by its size.
  // (An unknown length-delimited field: a valid message of any type.)
  constexpr size_t kBig = size_t{128} << 20;
  std::string big = {static_cast<char>(0xC2), static_cast<char>(0x3E)};  // field 1000, length-delimited
  size_t n = kBig;                                                       // its length, a varint
  for (; n >= 0x80; n >>= 7) big.push_back(static_cast<char>((n & 0x7F) | 0x80));
  big.push_back(static_cast<char>(n));
  big.resize(big.size() + kBig, 'x');
  for (const pid_t w : workers) {
    const int64_t peak = PeakRssBytes(w);
    int refused = 0;
    for (const int p : ListeningPorts({w})) {
      const grpc::Status st =
          GenericUnaryCall(grpc::CreateChannel("127.0.0.1:" + std::to_string(p), grpc::InsecureChannelCredentials()),
                           "/logprob.internal.v1.Worker/Run", big, std::chrono::seconds(60));
      refused += st.error_code() == grpc::StatusCode::UNAUTHENTICATED;
    }
    EXPECT_EQ(refused, 1) << "worker " << w << ": its Worker port refuses the call UNAUTHENTICATED";
    EXPECT_LT(PeakRssBytes(w) - peak, static_cast<int64_t>(kBig / 2)) << "worker " << w << " read the message";
  }
  // The pool is untouched: the same processes, no restart, the same bits.
  EXPECT_EQ(server->WorkerPids(), workers);
  const CommandResult scrape = ScrapeMetrics(metrics_port);
  EXPECT_EQ(MetricSample(scrape.output, "logprob_worker_restarts_total"), 0) << scrape.output;
  EXPECT_EQ(ScoreBytes(*stub, req), before);
}

/// A running cluster-mode server: --external-workers 2 on a loopback
/// control port with the pool secret file.
class ClusterPlane : public ::testing::Test {
 protected:
  void SetUp() override {
    control_ = "127.0.0.1:" + std::to_string(FreePort());
    server_ = ServerProcess::Launch({"--external-workers", "2", "--control-listen", control_, "--lm-head", LmHead(),
                                     "--internal-secret-file", PoolSecretFile()});
    ASSERT_TRUE(server_);
  }
  void TearDown() override {
    for (const pid_t p : workers_) {
      kill(p, SIGKILL);
      waitpid(p, nullptr, 0);
    }
  }
  std::string control_;
  std::unique_ptr<ServerProcess> server_;
  std::vector<pid_t> workers_;
};

TEST_F(ClusterPlane, WorkersJoinWithTheSecretFileAndAWorkerWithoutItIsRefused) {
  // Without the secret: refused for good, saying what to do.
  const CommandResult refused =
      RunCommand("timeout 60 " + BinDir() + "/logprob-worker --frontend " + control_ + " 2>&1");
  EXPECT_EQ(refused.code, 1) << refused.output;
  EXPECT_NE(refused.output.find("pool secret"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("--internal-secret-file"), std::string::npos) << refused.output;
  for (int i = 0; i < 2; ++i)
    workers_.push_back(SpawnProcess({BinDir() + "/logprob-worker", "--frontend", control_, "--internal-secret-file",
                                     PoolSecretFile(), "--exit-with-parent"}));
  auto stub = server_->NewStub();
  ASSERT_TRUE(WaitUntil("the cluster pool serves", [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ScoreResponse resp;
    return stub->Score(&ctx, RandomHiddenRequest(8, kH, kV, 1), &resp).ok();
  }));
  const v1::ScoreRequest req = RandomHiddenRequest(64, kH, kV, 3);
  const std::vector<std::string> before = ScoreBytes(*stub, req);
  std::vector<pid_t> tree = workers_;
  tree.push_back(server_->pid());
  std::vector<int> ports = ListeningPorts(tree);
  const int public_port = std::stoi(server_->address().substr(server_->address().rfind(':') + 1));
  ports.erase(std::remove_if(ports.begin(), ports.end(), [&](int p) { return p == public_port; }), ports.end());
  std::string output;
  ExpectAllRefused(Probe(ports, "", &output), 3, output);
  for (const pid_t p : workers_) EXPECT_EQ(waitpid(p, nullptr, WNOHANG), 0) << "worker " << p << " exited";
  EXPECT_EQ(ScoreBytes(*stub, req), before);
}

TEST(InternalPlane, AClusterFrontEndBeyondLoopbackNeedsASecretAndAPrivateSecretFile) {
  const std::string server = BinDir() + "/logprob-server --listen 127.0.0.1:" + std::to_string(FreePort()) +
                             " --external-workers 1 --control-listen 0.0.0.0:" + std::to_string(FreePort());
  CommandResult r = RunCommand("timeout 60 " + server + " 2>&1");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("needs --internal-secret-file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--insecure-internal-plane"), std::string::npos) << r.output;
  // A secret file other users can read is refused, and never printed.
  const std::string open_file = ::testing::TempDir() + "/world_readable_secret." + std::to_string(getpid());
  ASSERT_EQ(RunCommand("echo readable-secret-0123456789 > " + open_file + " && chmod 644 " + open_file).code, 0);
  r = RunCommand("timeout 60 " + server + " --internal-secret-file " + open_file + " 2>&1");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("other users can read it"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("readable-secret-0123456789"), std::string::npos) << r.output;
  std::remove(open_file.c_str());
}

TEST(InternalPlane, InsecureIsSaidAtEveryStartAndAWorkerListeningBeyondLoopbackNeedsTheSecret) {
  // --insecure-internal-plane starts, saying so in its log.
  const std::string log = ::testing::TempDir() + "/insecure_plane." + std::to_string(getpid()) + ".log";
  std::remove(log.c_str());
  auto server = ServerProcess::Launch({"--external-workers", "1", "--control-listen",
                                       "0.0.0.0:" + std::to_string(FreePort()), "--insecure-internal-plane"},
                                      log);
  ASSERT_TRUE(server);
  EXPECT_TRUE(WaitUntil("the warning in the log", [&] {
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return text.find("WARNING: --insecure-internal-plane") != std::string::npos;
  }));
  EXPECT_TRUE(server->Alive());
  server.reset();
  std::remove(log.c_str());
  // A worker listening on every interface is beyond loopback, whatever
  // address it advertises: refused without a secret, before it joins.
  const CommandResult r = RunCommand("timeout 60 " + BinDir() +
                                     "/logprob-worker --frontend 127.0.0.1:1 --listen-host 0.0.0.0 "
                                     "--advertise-host 127.0.0.1 2>&1");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("serving the Worker service on 0.0.0.0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--internal-secret-file"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace logprob::testing
