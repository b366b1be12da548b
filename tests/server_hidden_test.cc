// Integration: hidden-states scoring through live servers holding an
// lm_head (--lm-head). The golden hidden_bf16 case with 1, 2 and 3 workers;
// every other output (top-k, gather, temperature, sampling filters) against
// the logits path on logits computed in float64 in this test; sharded and
// tied-embedding checkpoints; errors; worker memory flat in T;
// --lm-head-precision fp32 against a float64 reference computed here.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "tests/test_support.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::testing {
namespace {

std::string GoldenLmHead() { return GoldenDir() + "/hidden_bf16.lm_head.safetensors"; }

/// The [V, H] weight of the golden lm_head file.
v1::Tensor GoldenWeight() {
  auto f = ReadSafetensors(GoldenLmHead());
  EXPECT_TRUE(f.ok()) << f.status();
  const v1::Tensor* w = f.ok() ? f->Find("lm_head.weight") : nullptr;
  return w ? *w : v1::Tensor();
}

v1::Tensor Renamed(v1::Tensor t, const std::string& name) {
  t.set_name(name);
  return t;
}

/// logits [.., V] (F32) = hidden [.., H] @ weight[V, H]^T, in float64 on
/// the exact bf16 values, then rounded to float32.
v1::Tensor LogitsFromHidden(const v1::Tensor& hidden, const v1::Tensor& weight) {
  const int64_t V = weight.shape(0), H = weight.shape(1);
  const int64_t rows = static_cast<int64_t>(hidden.data().size() / DTypeSize(hidden.dtype())) / H;
  std::vector<float> h(rows * H), w(V * H), out(rows * V);
  ToFloat(hidden.dtype(), hidden.data().data(), h.size(), h.data());
  ToFloat(weight.dtype(), weight.data().data(), w.size(), w.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += static_cast<double>(h[r * H + k]) * w[v * H + k];
      out[r * V + v] = static_cast<float>(acc);
    }
  v1::Tensor t;
  t.set_name("logits");
  t.set_dtype(v1::F32);
  t.mutable_shape()->CopyFrom(hidden.shape());
  t.set_shape(t.shape_size() - 1, V);
  t.set_data(out.data(), out.size() * 4);
  return t;
}

/// Sets every other target of the padded request `req` (next_token: row t
/// scores input_ids[t + 1]) to the argmax of its row's float64 logits
/// (the lowest id among equal maxima); returns how many it set.
int64_t SetArgmaxTargets(v1::ScoreRequest* req, const v1::Tensor& weight) {
  const v1::Tensor* hidden = nullptr;
  v1::Tensor* ids = nullptr;
  for (auto& t : *req->mutable_inputs()) {
    if (t.name() == "hidden_states") hidden = &t;
    if (t.name() == "input_ids") ids = &t;
  }
  EXPECT_TRUE(hidden && ids && ids->dtype() == v1::I64 && ids->shape_size() == 2);
  if (!hidden || !ids || ids->dtype() != v1::I64) return 0;
  const std::vector<float> x = Floats(LogitsFromHidden(*hidden, weight));
  const int64_t B = ids->shape(0), S = ids->shape(1), V = weight.shape(0);
  int64_t set = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t + 1 < S; t += 2) {
      const float* row = x.data() + (b * S + t) * V;
      const int64_t best = std::max_element(row, row + V) - row;  // the first maximum
      std::memcpy(ids->mutable_data()->data() + (b * S + t + 1) * 8, &best, 8);
      ++set;
    }
  return set;
}

/// `req` with its hidden_states replaced by the logits they map to.
v1::ScoreRequest AsLogitsRequest(const v1::ScoreRequest& req, const v1::Tensor& weight) {
  v1::ScoreRequest out = req;
  for (auto& t : *out.mutable_inputs())
    if (t.name() == "hidden_states") t = LogitsFromHidden(t, weight);
  return out;
}

v1::ScoreResponse MustScore(v1::LogprobService::Stub& stub, const v1::ScoreRequest& req) {
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  const grpc::Status st = stub.Score(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp;
}

std::vector<v1::Tensor> Outputs(const v1::ScoreResponse& r) { return {r.outputs().begin(), r.outputs().end()}; }

/// Scores the golden case; its token logprobs and entropy must match.
void ExpectGoldenMatches(v1::LogprobService::Stub& stub) {
  const GoldenCase c = LoadGolden("hidden_bf16");
  ASSERT_TRUE(c.options.entropy());
  EXPECT_EQ(CompareOutputs(c.expected.tensors, Outputs(MustScore(stub, GoldenRequest(c)))), "");
}

/// gather_indices [B, S - 1, K] I64 of deterministic ids in [0, V).
v1::Tensor GatherIds(int64_t B, int64_t S, int64_t K, int64_t V) {
  std::vector<int64_t> ids(B * S * K);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7919 + 13) % V);
  v1::Tensor t;
  t.set_name("gather_indices");
  t.set_dtype(v1::I64);
  for (int64_t d : {B, S, K}) t.add_shape(d);
  t.set_data(ids.data(), ids.size() * 8);
  return t;
}

class HiddenGolden : public ::testing::TestWithParam<int> {};

TEST_P(HiddenGolden, GoldenCaseAndEveryOutputMatchTheLogitsPath) {
  const int workers = GetParam();
  auto server = ServerProcess::Start(workers, {"--lm-head", GoldenLmHead(), "--hidden-chunk-tokens", "16"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  ExpectGoldenMatches(*stub);

  const GoldenCase c = LoadGolden("hidden_bf16");
  const v1::Tensor weight = GoldenWeight();
  const int64_t V = weight.shape(0);
  v1::ScoreRequest outputs = GoldenRequest(c);
  *outputs.add_inputs() = GatherIds(2, 31, 3, V);
  outputs.mutable_options()->set_topk(8);
  outputs.mutable_options()->set_temperature(0.7f);
  v1::ScoreRequest filters = GoldenRequest(c);
  filters.mutable_options()->set_sampling_top_k(50);
  filters.mutable_options()->set_sampling_top_p(0.9f);
  // is_top1 = 1 too: every other target is the argmax of its row.
  v1::ScoreRequest top1 = GoldenRequest(c);
  const int64_t top1_set = SetArgmaxTargets(&top1, weight);
  ASSERT_TRUE(top1.options().is_top1() && top1.options().log_sum_sq_probs() && top1.options().mean_logits());
  for (const auto* req : {&outputs, &filters, &top1}) {
    SCOPED_TRACE(req->options().ShortDebugString());
    const v1::ScoreResponse want = MustScore(*stub, AsLogitsRequest(*req, weight));
    const v1::ScoreResponse got = MustScore(*stub, *req);
    ASSERT_EQ(got.outputs_size(), want.outputs_size());
    EXPECT_EQ(CompareOutputs(Outputs(want), Outputs(got)), "");
  }
  const v1::ScoreResponse top1_resp = MustScore(*stub, top1);
  const v1::Tensor* is_top1 = FindOutput(top1_resp, "is_top1");
  ASSERT_NE(is_top1, nullptr);
  ASSERT_EQ(is_top1->dtype(), v1::I32);
  int64_t ones = 0;
  for (size_t i = 0; i < is_top1->data().size() / 4; ++i) ones += ReadInt(v1::I32, is_top1->data().data(), i);
  EXPECT_EQ(ones, top1_set);
  // The filters leave -inf for filtered targets: the case must exercise them.
  const auto filtered = Floats(*FindOutput(MustScore(*stub, filters), "token_logprobs"));
  EXPECT_GT(std::count_if(filtered.begin(), filtered.end(), [](float x) { return std::isinf(x); }), 0);
}

INSTANTIATE_TEST_SUITE_P(Workers, HiddenGolden, ::testing::Values(1, 2, 3));

/// A fresh directory under the test temp dir.
std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

v1::Tensor Zeros(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : shape) t.add_shape(d), n *= d;
  t.mutable_data()->assign(static_cast<size_t>(n) * DTypeSize(dtype), '\0');
  return t;
}

TEST(HiddenCheckpoint, ShardedIndexOverTwoFiles) {
  const std::string dir = TempDir("sharded");
  const v1::Tensor w = GoldenWeight();
  // The first shard holds a zero embedding: scoring with it would fail the golden case.
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors",
                               {Zeros("model.embed_tokens.weight", v1::BF16, {8192, 256}),
                                Zeros("model.norm.weight", v1::BF16, {256})})
                  .ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors", {w}).ok());
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata": {"total_size": 0}, "weight_map": {)"
      << R"("model.embed_tokens.weight": "model-00001-of-00002.safetensors",)"
      << R"("model.norm.weight": "model-00001-of-00002.safetensors",)"
      << R"("lm_head.weight": "model-00002-of-00002.safetensors"}})";
  auto server = ServerProcess::Start(2, {"--lm-head", dir});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  ExpectGoldenMatches(*stub);
  const v1::ServerInfo info = Info(*stub);
  EXPECT_EQ(info.vocab_size(), 8192);
  EXPECT_EQ(info.hidden_size(), 256);
  EXPECT_EQ(info.lm_head_dtype(), "BF16");
  EXPECT_EQ(info.lm_head_precision(), "bf16");  // --lm-head-precision auto on BF16 weights
  EXPECT_EQ(info.lm_head_tensor(), "lm_head.weight");
  EXPECT_NE(info.lm_head_path().find("model-00002-of-00002.safetensors"), std::string::npos) << info.lm_head_path();
}

TEST(HiddenCheckpoint, TiedEmbeddingsFallBackToTheInputEmbedding) {
  const std::string dir = TempDir("tied");
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", {Zeros("model.norm.weight", v1::BF16, {256}),
                                                            Renamed(GoldenWeight(), "model.embed_tokens.weight")})
                  .ok());
  auto server = ServerProcess::Start(1, {"--lm-head", dir + "/model.safetensors"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  ExpectGoldenMatches(*stub);
  EXPECT_EQ(Info(*stub).lm_head_tensor(), "model.embed_tokens.weight");
}

TEST(HiddenErrors, MismatchedHBothInputsNoLmHeadAndBadCheckpoint) {
  auto server = ServerProcess::Start(1, {"--lm-head", GoldenLmHead()});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const GoldenCase c = LoadGolden("hidden_bf16");
  auto expect_error = [&](const v1::ScoreRequest& req, grpc::StatusCode code, const std::string& needle) {
    grpc::ClientContext ctx;
    v1::ScoreResponse resp;
    const grpc::Status st = stub->Score(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), code) << st.error_message();
    EXPECT_NE(st.error_message().find(needle), std::string::npos) << st.error_message();
  };
  v1::ScoreRequest narrow = GoldenRequest(c);
  for (auto& t : *narrow.mutable_inputs())
    if (t.name() == "hidden_states") t = Zeros("hidden_states", v1::BF16, {2, 32, 128});
  expect_error(narrow, grpc::StatusCode::INVALID_ARGUMENT, "H = 128");
  v1::ScoreRequest both = GoldenRequest(c);
  *both.add_inputs() = Zeros("logits", v1::F32, {2, 32, 8192});
  expect_error(both, grpc::StatusCode::INVALID_ARGUMENT, "not both");

  auto plain = ServerProcess::Start(1);
  ASSERT_TRUE(plain);
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  const grpc::Status st = plain->NewStub()->Score(&ctx, GoldenRequest(c), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_NE(st.error_message().find("--lm-head"), std::string::npos) << st.error_message();

  const CommandResult bad = RunCommand(BinDir() + "/logprob-server --listen 127.0.0.1:" + std::to_string(FreePort()) +
                                       " --lm-head " + GoldenDir() + "/missing.safetensors");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("missing.safetensors"), std::string::npos) << bad.output;
}

/// Token logprobs and entropy of packed rows [T, H] (row t scores ids[t +
/// 1]) under weight [V, H], in float64 from the given operand values.
struct Reference {
  std::vector<double> logprobs, entropy;
};
Reference ReferenceScores(const std::vector<double>& h, const std::vector<double>& w, const std::vector<int64_t>& ids,
                          int64_t H, int64_t V) {
  Reference r;
  std::vector<double> z(V);
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += h[t * H + k] * w[v * H + k];
      z[v] = acc;
      mx = std::max(mx, acc);
    }
    double sum = 0, zp = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
    const double lse = mx + std::log(sum);
    for (int64_t v = 0; v < V; ++v) zp += std::exp(z[v] - lse) * z[v];
    r.logprobs.push_back(z[ids[t + 1]] - lse);
    r.entropy.push_back(lse - zp);
  }
  return r;
}

/// Entries of `got` outside docs/SPEC.md's tolerance 2e-4 + 2e-5 |want|.
int CountOutsideSpec(const std::vector<double>& want, const std::vector<float>& got) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= 2e-4 + 2e-5 * std::fabs(want[i]))) ++bad;
  return bad;
}

// --lm-head-precision fp32 on the golden BF16 lm_head: F32 hidden states
// are multiplied unrounded (a bf16 head would round them first), on 2
// workers (each its vocabulary slice), and ServerInfo says so.
TEST(HiddenPrecision, Fp32KeepsF32HiddenStatesAndServerInfoReportsIt) {
  auto server = ServerProcess::Start(2, {"--lm-head", GoldenLmHead(), "--lm-head-precision", "fp32"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  EXPECT_EQ(Info(*stub).lm_head_precision(), "fp32");

  const v1::Tensor weight = GoldenWeight();
  const int64_t V = weight.shape(0), H = weight.shape(1), T = 24;
  std::vector<float> wf(V * H);
  ToFloat(weight.dtype(), weight.data().data(), wf.size(), wf.data());
  const std::vector<double> w(wf.begin(), wf.end());
  // F32 hidden states with full 24-bit significands, larger than the
  // golden case's so that bf16 rounding moves the logprobs visibly.
  v1::ScoreRequest req = RandomPackedRequest("hidden_states", T, H, V, 31);
  std::mt19937 rng(32);
  std::normal_distribution<float> normal(0.f, 4.f);
  std::vector<float> hf(T * H);
  for (auto& x : hf) x = normal(rng);
  v1::Tensor& hidden = *req.mutable_inputs(0);
  ASSERT_EQ(hidden.name(), "hidden_states");
  hidden.set_dtype(v1::F32);
  hidden.set_data(hf.data(), hf.size() * 4);
  std::vector<int64_t> ids(T);
  std::memcpy(ids.data(), req.inputs(1).data().data(), ids.size() * 8);

  const std::vector<double> h(hf.begin(), hf.end());
  std::vector<double> h_bf16(h.size());
  for (size_t i = 0; i < h.size(); ++i) h_bf16[i] = Bf16ToFloat(FloatToBf16(hf[i]));
  const Reference want = ReferenceScores(h, w, ids, H, V), rounded = ReferenceScores(h_bf16, w, ids, H, V);

  const v1::ScoreResponse resp = MustScore(*stub, req);
  const auto lp = Floats(*FindOutput(resp, "token_logprobs")), ent = Floats(*FindOutput(resp, "entropy"));
  ASSERT_EQ(lp.size(), want.logprobs.size());
  ASSERT_EQ(ent.size(), want.entropy.size());
  for (size_t i = 0; i < lp.size(); ++i) {
    EXPECT_NEAR(lp[i], want.logprobs[i], 2e-4 + 2e-5 * std::fabs(want.logprobs[i])) << "token_logprobs row " << i;
    EXPECT_NEAR(ent[i], want.entropy[i], 2e-4 + 2e-5 * std::fabs(want.entropy[i])) << "entropy row " << i;
  }
  // The case tells the precisions apart: the bf16-rounded reference misses
  // the tolerance on most rows.
  EXPECT_GT(CountOutsideSpec(rounded.logprobs, lp), static_cast<int>(lp.size()) / 2);
}

TEST(HiddenPrecision, BadValueIsAStartupErrorNamingTheFlag) {
  const CommandResult server = RunCommand(
      BinDir() + "/logprob-server --listen 127.0.0.1:" + std::to_string(FreePort()) + " --lm-head-precision fp16");
  EXPECT_NE(server.code, 0);
  EXPECT_NE(server.output.find("--lm-head-precision 'fp16': must be auto, bf16, tf32 or fp32"), std::string::npos)
      << server.output;
  // The worker checks its own flag before contacting any front-end.
  const CommandResult worker = RunCommand(BinDir() + "/logprob-worker --frontend 127.0.0.1:1 --lm-head-precision FP32");
  EXPECT_NE(worker.code, 0);
  EXPECT_NE(worker.output.find("--lm-head-precision 'FP32': must be auto, bf16, tf32 or fp32"), std::string::npos)
      << worker.output;
}

// Every rank computes alike: a worker given another --lm-head-precision
// than its front-end's exits with a message naming both.
TEST(HiddenPrecision, WorkerDisagreeingWithTheFrontEndExits) {
  const std::string control = "127.0.0.1:" + std::to_string(FreePort());
  auto server = ServerProcess::Launch({"--external-workers", "1", "--control-listen", control, "--lm-head",
                                       GoldenLmHead(), "--lm-head-precision", "fp32"});
  ASSERT_TRUE(server);
  // --rejoin (the default) waits for the front-end's control port; the
  // disagreement then ends the worker for good.
  const CommandResult r =
      RunCommand("timeout 120 " + BinDir() + "/logprob-worker --frontend " + control + " --lm-head-precision bf16");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--lm-head-precision bf16 disagrees with the front-end's fp32"), std::string::npos)
      << r.output;
}

/// Occurrences of `needle` in the file at `path`.
int CountInFile(const std::string& path, const std::string& needle) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// --lm-head-cpu-kernel: the front-end's choice reaches every worker (each
// says so and multiplies in f32 with the widen kernel), ServerInfo reports
// it, and the widened bf16 products give the golden case on 2 workers.
TEST(HiddenCpuKernel, TheFrontEndsChoiceIsEveryWorkersAndMatchesTheGolden) {
  const std::string log = TempDir("cpu_kernel") + "/server.log";
  auto server = ServerProcess::Start(
      2, {"--lm-head", GoldenLmHead(), "--lm-head-cpu-kernel", "widen"},
      [](const std::string& a) { return grpc::CreateChannel(a, grpc::InsecureChannelCredentials()); }, log);
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  EXPECT_EQ(Info(*stub).lm_head_cpu_kernel(), "widen");
  ExpectGoldenMatches(*stub);
  EXPECT_EQ(CountInFile(log, "logprob-server: lm_head CPU kernel widen (set by --lm-head-cpu-kernel"), 1);
  EXPECT_EQ(CountInFile(log, "lm_head CPU kernel widen, lm_head store"), 2);  // rank 0 and rank 1
  EXPECT_EQ(CountInFile(log, "oneDNN f32 GEMM, bf16 operands, BF16 weights converted per tile"), 2);

  // auto resolves to one kernel for the pool, named in ServerInfo.
  auto automatic = ServerProcess::Start(1, {"--lm-head", GoldenLmHead()});
  ASSERT_TRUE(automatic);
  const std::string chosen = Info(*automatic->NewStub()).lm_head_cpu_kernel();
  EXPECT_TRUE(chosen == "bf16" || chosen == "widen") << chosen;
}

TEST(HiddenCpuKernel, BadValueIsAStartupErrorNamingTheFlag) {
  const CommandResult server = RunCommand(
      BinDir() + "/logprob-server --listen 127.0.0.1:" + std::to_string(FreePort()) + " --lm-head-cpu-kernel amx");
  EXPECT_NE(server.code, 0);
  EXPECT_NE(server.output.find("--lm-head-cpu-kernel 'amx': must be auto, bf16 or widen"), std::string::npos)
      << server.output;
}

// Same bits or none: a worker whose CPU lacks the pool's kernel (here a
// worker capped at AVX2, which has no bf16 matmul, joining a pool that
// runs bf16 dot products) exits naming the way out, and computes nothing.
TEST(HiddenCpuKernel, AWorkerLackingThePoolsKernelExits) {
  if (!kernels::Bf16MatmulSupported()) GTEST_SKIP() << "this CPU has no bf16 matmul: the front-end refuses bf16";
  const std::string control = "127.0.0.1:" + std::to_string(FreePort());
  auto native = ServerProcess::Launch({"--external-workers", "1", "--control-listen", control, "--lm-head",
                                       GoldenLmHead(), "--lm-head-cpu-kernel", "bf16"});
  ASSERT_TRUE(native);
  const CommandResult r =
      RunCommand("ONEDNN_MAX_CPU_ISA=AVX2 timeout 120 " + BinDir() + "/logprob-worker --frontend " + control);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("start the front-end with --lm-head-cpu-kernel widen"), std::string::npos) << r.output;
}

// The worker's logits buffer is one chunk, whatever T: scoring 16384 tokens
// (whose full logits would be 2 GiB of float32) must not raise the worker's
// peak RSS by more than the request's own hidden states and results.
TEST(HiddenMemory, WorkerPeakRssDoesNotGrowWithTokens) {
  if (kUnderSanitizer) GTEST_SKIP() << "RSS is not the program's under a sanitizer (shadow memory, quarantine)";
  constexpr int64_t V = 32000, H = 256, kSmall = 512, kLarge = 16384;
  const std::string dir = TempDir("memory");
  ASSERT_TRUE(WriteRandomLmHead(dir + "/lm_head.safetensors", V, H, 7).ok());
  auto server = ServerProcess::Start(1, {"--lm-head", dir + "/lm_head.safetensors", "--hidden-chunk-tokens", "64"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const auto workers = server->WorkerPids();
  ASSERT_EQ(workers.size(), 1u);

  MustScore(*stub, RandomHiddenRequest(kSmall, H, V, 1));
  const int64_t small_peak = PeakRssBytes(workers[0]);
  const v1::ScoreResponse large = MustScore(*stub, RandomHiddenRequest(kLarge, H, V, 2));
  const int64_t large_peak = PeakRssBytes(workers[0]);
  ASSERT_GT(small_peak, 0);
  const auto lp = Floats(*FindOutput(large, "token_logprobs"));
  ASSERT_EQ(lp.size(), static_cast<size_t>(kLarge - 1));
  for (float x : lp) ASSERT_TRUE(x <= 0.f && std::isfinite(x)) << x;
  const int64_t full_logits = kLarge * V * 4;
  const int64_t hidden_bytes = kLarge * H * 2;
  std::cout << "worker peak RSS: " << (small_peak >> 20) << " MiB after T=" << kSmall << ", " << (large_peak >> 20)
            << " MiB after T=" << kLarge << " (full logits would be " << (full_logits >> 20) << " MiB)" << std::endl;
  EXPECT_LT(large_peak - small_peak, 4 * hidden_bytes + (16 << 20));
}

}  // namespace
}  // namespace logprob::testing
