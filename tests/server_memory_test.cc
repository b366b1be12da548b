// The front-end's memory bound under load (issue 32, finding 6): with
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

TEST(MemoryBound, PeakRssStaysUnderThePrintedBoundWithEightClientsOf64MiBRequests) {
  if (kUnderSanitizer) GTEST_SKIP() << "RSS is not the program's under a sanitizer (shadow memory, quarantine)";
  const std::string dir = ::testing::TempDir() + "/server_memory." + std::to_string(getpid());
  ASSERT_EQ(RunCommand("mkdir -p " + dir).code, 0);
  const std::string head = dir + "/lm_head.safetensors";
  ASSERT_TRUE(WriteRandomLmHead(head, kV, kH, 5).ok());
  const std::vector<std::string> limits = {"--max-queue-bytes", std::to_string(int64_t{256} << 20),
                                           "--max-request-bytes", std::to_string(int64_t{128} << 20)};
  std::string flag_line = "--workers 2";
  for (const std::string& f : limits) flag_line += " " + f;
  const int64_t bound = PrintedBound(flag_line);
  ASSERT_GT(bound, 0);
  const int metrics_port = FreePort();
  std::vector<std::string> flags = limits;
  flags.insert(flags.end(), {"--lm-head", head, "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port)});
  auto server = ServerProcess::Start(2, flags);
  ASSERT_TRUE(server);

  // One request, serialized once: every client sends these bytes.
  grpc::ByteBuffer request;
  {
    bool own = false;
    const v1::ScoreRequest req = RandomHiddenRequest(kT, kH, kV, 11);
    ASSERT_GT(req.ByteSizeLong(), size_t{64} << 20);
    ASSERT_TRUE(grpc::SerializationTraits<v1::ScoreRequest>::Serialize(req, &request, &own).ok());
  }
  const std::string method = std::string("/") + v1::LogprobService::service_full_name() + "/Score";
  const grpc::internal::RpcMethod rpc(method.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);

  std::mutex mu;
  std::string first;  // the first answer's token_logprobs bytes
  std::vector<std::string> failures;
  std::atomic<int> answered{0}, refused{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c)
    clients.emplace_back([&, c] {
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(-1);
      args.SetInt("logprob.client", c);  // a connection of its own
      auto channel = grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args);
      for (int i = 0; i < kRequestsPerClient;) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
        grpc::ByteBuffer reply;
        const grpc::Status st = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
            channel.get(), rpc, &ctx, request, &reply);
        if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          // The queue is full (256 MiB: four requests): a client backs off and retries.
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
  for (auto& t : clients) t.join();
  for (const std::string& f : failures) ADD_FAILURE() << f;
  EXPECT_EQ(answered.load(), kClients * kRequestsPerClient);
  // The answers are logprobs: finite, <= 0, for the T - 1 scored rows.
  ASSERT_EQ(first.size(), static_cast<size_t>(kT - 1) * 4);
  std::vector<float> lp(kT - 1);
  std::memcpy(lp.data(), first.data(), first.size());
  for (int64_t t = 0; t + 1 < kT; ++t) ASSERT_TRUE(std::isfinite(lp[t]) && lp[t] <= 0) << "row " << t << ": " << lp[t];

  const CommandResult metrics = ScrapeMetrics(metrics_port);
  ASSERT_EQ(metrics.code, 0) << metrics.output;
  const double kept_at_end = MetricSample(metrics.output, "logprob_kept_freed_bytes");
  const int64_t peak = PeakRssBytes(server->pid());
  std::cerr << "front-end peak RSS " << (peak >> 20) << " MiB, bound " << (bound >> 20) << " MiB, kept freed "
            << static_cast<int64_t>(kept_at_end) / (1 << 20) << " MiB after the last answer, " << refused.load()
            << " refusals retried\n";
  EXPECT_GT(peak, int64_t{64} << 20);
  EXPECT_LT(peak, bound) << "the front-end's peak RSS exceeds its memory bound";
  // What gRPC frees after the last trim around a request (the last
  // answers' buffers, released once sent) can take kept-freed memory over
  // the cap (131-148 MiB seen in 1 run of 3); the server's once-a-second
  // trim brings it back under without another request. The bug this
  // guards against (issue 32) left 642 MiB.
  double kept = kept_at_end;
  EXPECT_TRUE(WaitUntil("kept-freed memory within --keep-freed-memory-bytes (128 MiB)",
                        [&] {
                          const CommandResult m = ScrapeMetrics(metrics_port);
                          kept = m.code == 0 ? MetricSample(m.output, "logprob_kept_freed_bytes") : -1;
                          return kept >= 0 && kept <= static_cast<double>(int64_t{128} << 20);
                        }))
      << "last seen " << static_cast<int64_t>(kept) / (1 << 20) << " MiB";
  server.reset();
  RunCommand("rm -rf " + dir);
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
