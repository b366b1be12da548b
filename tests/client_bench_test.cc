// `logprob-client bench` end to end against a live 2-worker server (with
// /metrics): short runs whose JSON and table reports carry sane values,
// and command-line errors that name the flag. No timed assertions.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "nlohmann/json.hpp"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

class ClientBench : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    metrics_port_ = FreePort();
    // A 4 MB message limit so that an over-limit shape is cheap to build.
    server_ = ServerProcess::Start(2, {"--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port_),
                                       "--max-request-bytes", "4000000"})
                  .release();
  }
  static void TearDownTestSuite() { delete server_; }

  static std::string MetricsUrl() { return "http://127.0.0.1:" + std::to_string(metrics_port_) + "/metrics"; }

  /// Runs `logprob-client bench --server ADDRESS ARGS`; stdout and stderr
  /// come back separately.
  struct BenchRun {
    int code;
    std::string out, err;
  };
  static BenchRun Bench(const std::string& args) {
    const std::string err_path =
        ::testing::TempDir() + "/" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".stderr";
    const CommandResult r = RunCommand("(" + BinDir() + "/logprob-client bench --server " + server_->address() + " " +
                                       args + " 2>" + err_path + ")");
    std::ifstream in(err_path);
    std::stringstream err;
    err << in.rdbuf();
    return {r.code, r.output, err.str()};
  }

  static ServerProcess* server_;
  static int metrics_port_;
};
ServerProcess* ClientBench::server_ = nullptr;
int ClientBench::metrics_port_ = 0;

// Checks one phase of the JSON report; returns its OK request count.
int64_t CheckPhase(const nlohmann::json& p, int64_t tokens_per_request, int64_t request_bytes) {
  const int64_t ok = p.at("requests_ok").get<int64_t>();
  EXPECT_GT(ok, 0) << p;
  EXPECT_EQ(p.at("requests_failed").get<int64_t>(), 0) << p;
  EXPECT_TRUE(p.at("failures").empty()) << p;
  const double seconds = p.at("seconds").get<double>();
  EXPECT_GT(seconds, 0);
  const double rps = p.at("requests_per_s").get<double>();
  EXPECT_NEAR(rps, ok / seconds, 1e-9 * rps);
  EXPECT_NEAR(p.at("tokens_per_s").get<double>(), rps * tokens_per_request, 1e-6 * rps * tokens_per_request);
  EXPECT_NEAR(p.at("request_mb_per_s").get<double>(), rps * request_bytes / 1e6, 1e-9 * rps * request_bytes);
  const nlohmann::json& l = p.at("latency_s");
  EXPECT_EQ(l.at("count").get<int64_t>(), ok);
  const double min = l.at("min"), p50 = l.at("p50"), p90 = l.at("p90"), p99 = l.at("p99"), max = l.at("max"),
               mean = l.at("mean");
  EXPECT_GT(min, 0);
  EXPECT_LE(min, p50);
  EXPECT_LE(p50, p90);
  EXPECT_LE(p90, p99);
  EXPECT_LE(p99, max);
  EXPECT_GE(mean, min);
  EXPECT_LE(mean, max);
  // Every call of a phase finished within the phase.
  EXPECT_LE(max, seconds);
  return ok;
}

TEST_F(ClientBench, JsonReportWithEchoAndServerSplit) {
  ASSERT_TRUE(server_);
  const BenchRun r = Bench(
      "--batch 2 --seq 64 --vocab 1000 --dtype f32 --entropy --topk 5 --concurrency 2 "
      "--duration 1 --warmup 0.2 --progress 0.4 --json --metrics-url " +
      MetricsUrl());
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j.at("concurrency"), 2);
  EXPECT_EQ(j.at("tokens_per_request"), 128);
  EXPECT_EQ(j.at("shape").at("dtype"), "F32");
  EXPECT_EQ(j.at("options"), "entropy: true topk: 5");
  const int64_t request_bytes = j.at("request_bytes");
  EXPECT_GT(request_bytes, 2 * 64 * 1000 * 4 + 2 * 64 * 8);  // logits + input_ids
  EXPECT_LT(request_bytes, 2 * 64 * 1000 * 4 + 2 * 64 * 8 + 1000);
  // token_logprobs and entropy [2, 63], topk_logprobs [2, 63, 5] f32 and topk_indices i64.
  const int64_t reply_bytes = j.at("reply_bytes");
  EXPECT_GT(reply_bytes, 2 * 63 * (4 + 4 + 5 * 4 + 5 * 8));
  EXPECT_LT(reply_bytes, 2 * 63 * (4 + 4 + 5 * 4 + 5 * 8) + 1000);

  const int64_t scored = CheckPhase(j.at("scoring"), 128, request_bytes);
  const int64_t echoed = CheckPhase(j.at("echo"), 128, request_bytes);
  EXPECT_GT(echoed, 0);
  const double ratio = j.at("scoring_over_echo");
  EXPECT_GT(ratio, 0);
  EXPECT_LE(ratio, 10);  // scoring cannot be much faster than moving the same bytes
  EXPECT_NEAR(ratio, j["scoring"]["requests_per_s"].get<double>() / j["echo"]["requests_per_s"].get<double>(), 1e-9);

  // Scraped after the warm-up and after the measured calls: exactly the measured requests.
  const nlohmann::json& split = j.at("server_split");
  ASSERT_TRUE(split.is_object()) << j;
  EXPECT_EQ(split.at("requests").get<double>(), scored);
  const double request = split.at("request_mean_s"), call = split.at("worker_call_mean_s"),
               compute = split.at("compute_mean_s");
  EXPECT_GT(compute, 0);
  EXPECT_LE(compute, call);
  // Concurrent requests may share worker batches (dynamic batching).
  EXPECT_GE(split.at("batches").get<double>(), 1);
  EXPECT_LE(split.at("batches").get<double>(), scored);
  EXPECT_GE(split.at("queue_mean_s").get<double>(), 0);
  EXPECT_LE(split.at("queue_mean_s").get<double>(), request);
  EXPECT_LE(call, request);
  EXPECT_LE(request, j["scoring"]["latency_s"]["mean"].get<double>());

  EXPECT_NE(r.err.find("bench scoring: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("bench echo: "), std::string::npos) << r.err;
}

TEST_F(ClientBench, TableWithRequestCountPackedNoEcho) {
  ASSERT_TRUE(server_);
  const BenchRun r = Bench("--packed 96 --batch 3 --vocab 500 --concurrency 3 --requests 7 --warmup 0 --no-echo");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("logits BF16 [96, 500] packed, 3 sequences"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("96 tokens"), std::string::npos) << r.out;
  // phase, requests, failed, seconds, req/s, tokens/s, MB/s, mean, p50, p90, p99, max
  const std::regex row(
      R"(\nscoring +7 +0 +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+))");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, row)) << r.out;
  EXPECT_GT(std::stod(m[2]), 0);                                                   // req/s
  EXPECT_NEAR(std::stod(m[3]), std::stod(m[2]) * 96, 1 + 0.01 * std::stod(m[3]));  // tokens/s (rounded)
  EXPECT_LE(std::stod(m[6]), std::stod(m[7]));                                     // p50 <= p90 (ms, rounded alike)
  EXPECT_LE(std::stod(m[7]), std::stod(m[8]));                                     // p90 <= p99
  EXPECT_LE(std::stod(m[8]), std::stod(m[9]));                                     // p99 <= max
  EXPECT_EQ(r.out.find("\necho "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("scoring / echo"), std::string::npos) << r.out;
}

TEST_F(ClientBench, BadFlagsAreClearErrors) {
  ASSERT_TRUE(server_);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--concurrency 0", "--concurrency: '0' is not an integer > 0"},
      {"--concurrency many", "--concurrency: 'many' is not an integer > 0"},
      {"--dtype i8", "--dtype: 'i8' is not bf16, f16 or f32"},
      {"--seq 8 --packed 16", "--packed T and --seq S exclude each other"},
      {"--packed 2 --batch 4", "--packed 2: fewer tokens than the --batch 4 sequences"},
      {"--duration 1 --requests 3", "--requests and --duration exclude each other"},
      {"--duration 0", "--duration: '0' is not a number of seconds > 0"},
      {"--warmup -1", "--warmup: '-1' is not a number of seconds >= 0"},
      {"--batch 100 --seq 100 --vocab 100000000", "over gRPC's 2 GiB message limit"},
      {"--json=maybe", "--json: 'maybe' is not true or false"},
      {"--bogus 1", "bench: unknown flag --bogus"},
      {"--tls-cert c.pem", "--tls-cert and --tls-key go together"},
  };
  for (const auto& [args, message] : cases) {
    SCOPED_TRACE(args);
    const BenchRun r = Bench(args);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_NE(r.err.find("error: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
  const CommandResult no_server = RunCommand(BinDir() + "/logprob-client bench --batch 2");
  EXPECT_EQ(no_server.code, 2);
  EXPECT_NE(no_server.output.find("bench: --server is required"), std::string::npos) << no_server.output;
}

TEST_F(ClientBench, ServerSideErrorsAreClear) {
  ASSERT_TRUE(server_);
  // 4 x 512 x 1000 f32 = 8 MB, over the server's 4 MB limit: refused before any load.
  BenchRun r = Bench("--batch 4 --seq 512 --vocab 1000 --dtype f32 --duration 1");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("over the server's max_request_bytes 4000000"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;

  // The probe call carries the server's own message.
  r = Bench("--batch 2 --seq 8 --vocab 100 --topk 5000 --duration 1");
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("INVALID_ARGUMENT: probe request: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("options.topk"), std::string::npos) << r.err;

  r = Bench("--batch 2 --seq 8 --vocab 100 --duration 1 --metrics-url ftp://127.0.0.1/metrics");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("--metrics-url ftp://127.0.0.1/metrics: expected http://HOST:PORT[/PATH]"), std::string::npos)
      << r.err;

  const CommandResult dead =
      RunCommand(BinDir() + "/logprob-client bench --server 127.0.0.1:" + std::to_string(FreePort()) +
                 " --batch 2 --seq 8 --vocab 100 --timeout 2");
  EXPECT_EQ(dead.code, 1) << dead.output;
  EXPECT_NE(dead.output.find("error: "), std::string::npos) << dead.output;
}

TEST_F(ClientBench, HiddenSizeModeChecksTheServersLmHeadAndSendsInPieces) {
  ASSERT_TRUE(server_);
  // The suite's server has no lm_head.
  BenchRun r = Bench("--hidden-size 64 --batch 1 --seq 8 --requests 1");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("--hidden-size 64: the server " + server_->address() + " has no lm_head"), std::string::npos)
      << r.err;

  // A small f32 lm_head [512, 64].
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 0.05f);
  std::vector<float> w(512 * 64);
  for (float& x : w) x = normal(rng);
  v1::Tensor t;
  t.set_name("lm_head.weight");
  t.set_dtype(v1::F32);
  t.add_shape(512);
  t.add_shape(64);
  t.set_data(reinterpret_cast<const char*>(w.data()), w.size() * 4);
  const std::string lm = ::testing::TempDir() + "/bench_lm_head." + std::to_string(getpid()) + ".safetensors";
  ASSERT_TRUE(WriteSafetensors(lm, {t}).ok());
  auto hidden_server = ServerProcess::Start(2, {"--lm-head", lm});
  ASSERT_TRUE(hidden_server);
  const std::string bench = BinDir() + "/logprob-client bench --server " + hidden_server->address();
  CommandResult c = RunCommand(bench + " --hidden-size 32 --batch 1 --seq 8 --requests 1");
  EXPECT_EQ(c.code, 2) << c.output;
  EXPECT_NE(c.output.find("--hidden-size 32: the server's lm_head is [512, 64] (H = 64)"), std::string::npos)
      << c.output;

  // 256 rows of bf16 [.., 64] (32 kB) over --chunk-above 4096: ScoreChunked in 1000-byte pieces.
  c = RunCommand(bench +
                 " --hidden-size 64 --packed 256 --batch 2 --requests 3 --warmup 0 --progress 0 --json "
                 "--chunk-above 4096 --piece-bytes 1000 2>/dev/null");
  std::remove(lm.c_str());
  ASSERT_EQ(c.code, 0) << c.output;
  const nlohmann::json j = nlohmann::json::parse(c.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << c.output;
  EXPECT_EQ(j.at("transport"), "ScoreChunked");
  EXPECT_EQ(j.at("shape").at("hidden_size"), 64);
  EXPECT_EQ(j.at("shape").at("vocab"), 512);
  const int64_t request_bytes = j.at("request_bytes");
  EXPECT_GT(request_bytes, 256 * 64 * 2 + 256 * 8);  // hidden_states + input_ids
  CheckPhase(j.at("scoring"), 256, request_bytes);
  CheckPhase(j.at("echo"), 256, request_bytes);
  CheckPhase(j.at("echo_chunked"), 256, request_bytes);
  EXPECT_NEAR(j.at("scoring_over_echo").get<double>(),
              j["scoring"]["requests_per_s"].get<double>() / j["echo_chunked"]["requests_per_s"].get<double>(), 1e-9);
}

}  // namespace
}  // namespace logprob::testing
