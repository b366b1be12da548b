// The front-end's memory bound under load: with
// --max-queue-bytes 256 MiB and --max-request-bytes 128 MiB, 8 clients,
// each on its own connection, send unary 64 MiB hidden-states requests
// back to back; the front-end's peak RSS (VmHWM) must stay under the bound
// `--print-memory-bound` prints for the same flags, and the freed heap it
// keeps resident (logprob_kept_freed_bytes) under its setting. Every
// answer is checked: the clients send the same request, so every answer
// must be the first one's, bit for bit. Label "stress" (a minute of load;
// RSS is the point, so not under a sanitizer).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int64_t kV = 64, kH = 4096, kT = 8192;  // hidden states: 64 MiB of bf16
constexpr int kClients = 8, kRequestsPerClient = 4;

/// The frontend_bytes= field `logprob-server --print-memory-bound FLAGS` prints.
int64_t PrintedBound(const std::string& flags) {
  const CommandResult r = RunCommand(BinDir() + "/logprob-server --print-memory-bound " + flags);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("frontend_bytes=", 0), 0u) << r.output;
  return std::strtoll(r.output.c_str() + std::string("frontend_bytes=").size(), nullptr, 10);
}

/// What one burst saw.
struct Burst {
  int64_t peak = 0, bound = 0;
  int refused = 0;
};

/// `clients` clients, each on its own connection, send `requests` unary
/// hidden-states requests of `tokens` x 4096 bf16 (unannounced: each
/// reserves max_request_bytes) to a server with --max-queue-bytes 256 MiB
/// and --max-request-bytes 128 MiB, backing off 20 ms after a refusal.
/// Every answer must be the first one's, bit for bit, and logprobs.
/// `check_kept`: also wait for the kept-freed memory to come back under
/// its cap. Returns the peak RSS and the printed bound.
Burst RunBurst(int clients, int requests, int64_t tokens, bool check_kept) {
  Burst out;
  const std::string dir = ::testing::TempDir() + "/server_memory." + std::to_string(getpid());
  EXPECT_EQ(RunCommand("mkdir -p " + dir).code, 0);
  const std::string head = dir + "/lm_head.safetensors";
  EXPECT_TRUE(WriteRandomLmHead(head, kV, kH, 5).ok());
  const std::vector<std::string> limits = {"--max-queue-bytes", std::to_string(int64_t{256} << 20),
                                           "--max-request-bytes", std::to_string(int64_t{128} << 20)};
  std::string flag_line = "--workers 2";
  for (const std::string& f : limits) flag_line += " " + f;
  out.bound = PrintedBound(flag_line);
  EXPECT_GT(out.bound, 0);
  const int metrics_port = FreePort();
  std::vector<std::string> flags = limits;
  flags.insert(flags.end(), {"--lm-head", head, "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port)});
  auto server = ServerProcess::Start(2, flags);
  if (!server) return out;

  // One request, serialized once: every client sends these bytes.
  grpc::ByteBuffer request;
  {
    bool own = false;
    const v1::ScoreRequest req = RandomHiddenRequest(tokens, kH, kV, 11);
    EXPECT_GT(req.ByteSizeLong(), static_cast<size_t>(tokens * kH * 2));
    EXPECT_TRUE(grpc::SerializationTraits<v1::ScoreRequest>::Serialize(req, &request, &own).ok());
  }
  const std::string method = std::string("/") + v1::LogprobService::service_full_name() + "/Score";
  const grpc::internal::RpcMethod rpc(method.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);

  std::mutex mu;
  std::string first;  // the first answer's token_logprobs bytes
  std::vector<std::string> failures;
  std::atomic<int> answered{0}, refused{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(-1);
      args.SetInt("logprob.client", c);  // a connection of its own
      auto channel = grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args);
      for (int i = 0; i < requests;) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
        grpc::ByteBuffer reply;
        const grpc::Status st = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
            channel.get(), rpc, &ctx, request, &reply);
        if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          // The queue is full: a client backs off and retries (the retry
          // policy under test, not a synchronisation).
          ++refused;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          continue;
        }
        ++i;
        std::lock_guard<std::mutex> lock(mu);
        v1::ScoreResponse resp;
        if (!st.ok() || !grpc::SerializationTraits<v1::ScoreResponse>::Deserialize(&reply, &resp).ok()) {
          failures.push_back(absl::StrCat("client ", c, ": ", st.error_code(), " ", st.error_message()));
          continue;
        }
        ++answered;
        std::string lp;
        for (const v1::Tensor& t : resp.outputs())
          if (t.name() == "token_logprobs") lp = t.data();
        if (first.empty()) first = lp;
        if (lp.empty() || lp != first) failures.push_back(absl::StrCat("client ", c, ": another answer"));
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(answered.load(), clients * requests);
  out.refused = refused.load();
  // The answers are logprobs: finite, <= 0, for the T - 1 scored rows.
  EXPECT_EQ(first.size(), static_cast<size_t>(tokens - 1) * 4);
  std::vector<float> lp(first.size() / 4);
  std::memcpy(lp.data(), first.data(), lp.size() * 4);
  for (size_t t = 0; t < lp.size(); ++t) {
    EXPECT_TRUE(std::isfinite(lp[t]) && lp[t] <= 0) << "row " << t << ": " << lp[t];
    if (!std::isfinite(lp[t]) || lp[t] > 0) break;
  }
  out.peak = PeakRssBytes(server->pid());
  if (check_kept) {
    // What gRPC frees after the last trim around a request (the last
    // answers' buffers, released once sent) can take kept-freed memory over
    // the cap (131-148 MiB seen in 1 run of 3); the server's once-a-second
    // trim brings it back under without another request. The bug this
    // guards against (issue 32) left 642 MiB.
    double kept = -1;
    EXPECT_TRUE(WaitUntil("kept-freed memory within --keep-freed-memory-bytes (128 MiB)",
                          [&] {
                            const CommandResult m = ScrapeMetrics(metrics_port);
                            kept = m.code == 0 ? MetricSample(m.output, "logprob_kept_freed_bytes") : -1;
                            return kept >= 0 && kept <= static_cast<double>(int64_t{128} << 20);
                          }))
        << "last seen " << static_cast<int64_t>(kept) / (1 << 20) << " MiB";
  }
  server.reset();
  RunCommand("rm -rf " + dir);
  return out;
}

TEST(MemoryBound, PeakRssStaysUnderThePrintedBoundWithEightClientsOf64MiBRequests) {
  if (kUnderSanitizer) GTEST_SKIP() << "RSS is not the program's under a sanitizer (shadow memory, quarantine)";
  const Burst b = RunBurst(kClients, kRequestsPerClient, kT, /*check_kept=*/true);
  std::cerr << "front-end peak RSS " << (b.peak >> 20) << " MiB, bound " << (b.bound >> 20) << " MiB, " << b.refused
            << " refusals retried\n";
  EXPECT_GT(b.peak, int64_t{64} << 20);
  EXPECT_LT(b.peak, b.bound) << "the front-end's peak RSS exceeds its memory bound";
}

// Bursts that took the front-end over its bound when refused requests were
// read whole before the refusal (1468-1741 MiB against 1344 on a busy
// machine): 12 and 16 clients of 64 MiB, 8 of 120 MiB, one request each,
// beside two busy loops. Requests are now refused before their bodies are
// read, so the peak stays under the bound whatever the timing.
TEST(MemoryBound, BurstsOfRefusedClientsStayUnderTheBoundBesideBusyLoops) {
  if (kUnderSanitizer) GTEST_SKIP() << "RSS is not the program's under a sanitizer (shadow memory, quarantine)";
  std::vector<pid_t> busy;
  for (int i = 0; i < 2; ++i) busy.push_back(SpawnProcess({"/bin/sh", "-c", "while :; do :; done"}));
  struct Case {
    int clients;
    int64_t tokens;
  };
  for (const Case& c : {Case{12, kT}, Case{16, kT}, Case{8, 15360}}) {  // 64, 64, 120 MiB
    const Burst b = RunBurst(c.clients, 1, c.tokens, /*check_kept=*/false);
    std::cerr << c.clients << " clients x " << (c.tokens * kH * 2 >> 20) << " MiB: front-end peak RSS "
              << (b.peak >> 20) << " MiB, bound " << (b.bound >> 20) << " MiB, " << b.refused << " refusals retried\n";
    EXPECT_LT(b.peak, b.bound) << c.clients << " clients of " << (c.tokens * kH * 2 >> 20) << " MiB";
  }
  for (const pid_t pid : busy) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
}

// The store files of updated heads are in the bound (issue 32, finding 6):
// three updates of a 64 MiB head through the CLI, small queue limits; the
// front-end's peak RSS stays under the printed bound, which names the store.
TEST(MemoryBound, StoreFilesOfUpdatedHeadsAreInTheBound) {
  if (kUnderSanitizer) GTEST_SKIP() << "RSS is not the program's under a sanitizer (shadow memory, quarantine)";
  constexpr int64_t V = 8192, H = 4096;  // 64 MiB of bf16
  const std::string dir = ::testing::TempDir() + "/server_memory_store." + std::to_string(getpid());
  ASSERT_EQ(RunCommand("mkdir -p " + dir).code, 0);
  const std::string head = dir + "/head.safetensors";
  ASSERT_TRUE(WriteRandomLmHead(head, V, H, 1).ok());
  const std::vector<std::string> flags = {"--max-queue-bytes",
                                          std::to_string(int64_t{16} << 20),
                                          "--max-request-bytes",
                                          std::to_string(int64_t{16} << 20),
                                          "--lm-head",
                                          head,
                                          "--allow-lm-head-updates"};
  std::string flag_line = "--workers 1";
  for (const std::string& f : flags) flag_line += " " + f;
  const CommandResult printed = RunCommand(BinDir() + "/logprob-server --print-memory-bound " + flag_line);
  ASSERT_EQ(printed.code, 0) << printed.output;
  EXPECT_NE(printed.output.find("lm_head store 257 MiB"), std::string::npos)
      << printed.output;  // (64 MiB + a page) x (1 + 3)
  const int64_t bound = PrintedBound(flag_line);
  auto server = ServerProcess::Start(1, flags);
  ASSERT_TRUE(server);
  for (int v = 2; v <= 4; ++v) {
    const std::string weights = dir + "/v" + std::to_string(v) + ".safetensors";
    ASSERT_TRUE(WriteRandomLmHead(weights, V, H, static_cast<uint32_t>(v)).ok());
    const CommandResult r =
        RunCommand(BinDir() + "/logprob-client update-lm-head --server " + server->address() +
                   " --head default --version v" + std::to_string(v) + " --rows-per-call 1024 --input " + weights);
    ASSERT_EQ(r.code, 0) << r.output;
  }
  const int64_t peak = PeakRssBytes(server->pid());
  std::cerr << "front-end peak RSS after 3 updates " << (peak >> 20) << " MiB, bound " << (bound >> 20) << " MiB\n";
  EXPECT_GT(peak, int64_t{64} << 20);
  EXPECT_LT(peak, bound);
  server.reset();
  RunCommand("rm -rf " + dir);
}

}  // namespace
}  // namespace logprob::testing
