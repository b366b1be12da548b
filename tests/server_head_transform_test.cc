// Integration: heads with a logit transform (docs/SPEC.md "The head's
// logits"), through live servers started with `--lm-head DIR` on a tiny
// Hugging Face-style checkpoint directory written here (config.json +
// model.safetensors with lm_head.weight BF16 and lm_head.bias): a
// Gemma-2-style head (final_logit_softcapping 30) and a Granite-style one
// (logits_scaling 8: logits divided by 8), each with a bias, on 1 and 3 CPU
// workers. Every token logprob and entropy against float64 of
// softcap(scale * (h W^T + b)) / T on the same bf16 values; bitwise the same
// rows alone and in a bigger batch; top-k, gathered ids and sampling
// filters equal the logits path on the transformed logits; GetServerInfo;
// a bare file with flags;
// refusals at start (unknown transform, flag contradicting config.json);
// the transformers golden of two transformed heads (HeadTransformGolden).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int64_t kV = 1000, kH = 64;

/// A fresh directory under the test temp dir.
std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name + "." + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

v1::Tensor MakeTensor(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
                      size_t bytes) {
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(data, bytes);
  return t;
}

/// A head as the test knows it: weight [V, H] and bias [V] as the exact
/// values stored (bf16 weight; bias of `bias_dtype`), and its scalars.
struct Head {
  std::vector<double> w, b;
  double scale = 1, softcap = 0;
};

/// Writes DIR/config.json (`config`) and DIR/model.safetensors (a decoy
/// norm, lm_head.weight BF16 normal(0, w_std), lm_head.bias of
/// `bias_dtype` normal(0, 2)); returns the stored values.
Head WriteCheckpoint(const std::string& dir, const std::string& config, DType bias_dtype, double w_std, uint32_t seed) {
  std::ofstream(dir + "/config.json") << config;
  std::mt19937 rng(seed);
  std::normal_distribution<float> wd(0.f, static_cast<float>(w_std)), bd(0.f, 2.f);
  Head head;
  std::vector<uint16_t> w(kV * kH);
  for (auto& x : w) x = FloatToBf16(wd(rng));
  head.w.resize(w.size());
  for (size_t i = 0; i < w.size(); ++i) head.w[i] = Bf16ToFloat(w[i]);
  std::vector<float> bias_f32(kV);
  std::vector<uint16_t> bias_bf16(kV);
  head.b.resize(kV);
  for (int64_t v = 0; v < kV; ++v) {
    const float x = bd(rng);
    bias_bf16[v] = FloatToBf16(x);
    bias_f32[v] = x;
    head.b[v] = bias_dtype == v1::BF16 ? Bf16ToFloat(bias_bf16[v]) : x;
  }
  const std::vector<float> norm(kH, 1.0f);
  const v1::Tensor bias = bias_dtype == v1::BF16
                              ? MakeTensor("lm_head.bias", v1::BF16, {kV}, bias_bf16.data(), bias_bf16.size() * 2)
                              : MakeTensor("lm_head.bias", v1::F32, {kV}, bias_f32.data(), bias_f32.size() * 4);
  const absl::Status st = WriteSafetensors(
      dir + "/model.safetensors", {MakeTensor("model.norm.weight", v1::F32, {kH}, norm.data(), norm.size() * 4),
                                   MakeTensor("lm_head.weight", v1::BF16, {kV, kH}, w.data(), w.size() * 2), bias});
  EXPECT_TRUE(st.ok()) << st;
  return head;
}

/// A packed hidden-states request: sequences of `lens` tokens, rows bf16
/// normal(0, 1) from `seed`, ids in [0, V); entropy on.
struct Batch {
  v1::ScoreRequest req;
  std::vector<double> h;  // [T, H] the bf16 values
  std::vector<int64_t> ids, cu;
};
Batch MakeBatch(const std::vector<int64_t>& lens, uint32_t seed, float temperature) {
  Batch b;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  int64_t T = 0;
  b.cu.push_back(0);
  for (int64_t n : lens) b.cu.push_back(T += n);
  std::vector<uint16_t> h(T * kH);
  for (auto& x : h) x = FloatToBf16(normal(rng));
  b.h.resize(h.size());
  for (size_t i = 0; i < h.size(); ++i) b.h[i] = Bf16ToFloat(h[i]);
  b.ids.resize(T);
  for (auto& id : b.ids) id = static_cast<int64_t>(rng() % kV);
  *b.req.add_inputs() = MakeTensor("hidden_states", v1::BF16, {T, kH}, h.data(), h.size() * 2);
  *b.req.add_inputs() = MakeTensor("input_ids", v1::I64, {T}, b.ids.data(), b.ids.size() * 8);
  *b.req.add_inputs() =
      MakeTensor("cu_seqlens", v1::I64, {static_cast<int64_t>(b.cu.size())}, b.cu.data(), b.cu.size() * 8);
  b.req.mutable_options()->set_entropy(true);
  b.req.mutable_options()->set_temperature(temperature);
  return b;
}

/// Token logprobs and entropy of every scored position (packed: position t
/// of a sequence scores its token t + 1), in float64: x = softcap(scale *
/// (h W^T + b)) / temperature.
void Reference(const Head& head, const Batch& b, double temperature, std::vector<double>* logprobs,
               std::vector<double>* entropy) {
  std::vector<double> x(kV);
  for (size_t s = 0; s + 1 < b.cu.size(); ++s)
    for (int64_t t = b.cu[s]; t + 1 < b.cu[s + 1]; ++t) {
      double mx = -INFINITY;
      for (int64_t v = 0; v < kV; ++v) {
        double acc = 0;
        for (int64_t k = 0; k < kH; ++k) acc += b.h[t * kH + k] * head.w[v * kH + k];
        double z = head.scale * (acc + head.b[v]);
        if (head.softcap > 0) z = head.softcap * std::tanh(z / head.softcap);
        x[v] = z / temperature;
        mx = std::max(mx, x[v]);
      }
      double sum = 0, xp = 0;
      for (int64_t v = 0; v < kV; ++v) sum += std::exp(x[v] - mx);
      const double lse = mx + std::log(sum);
      for (int64_t v = 0; v < kV; ++v) xp += std::exp(x[v] - lse) * x[v];
      logprobs->push_back(x[b.ids[t + 1]] - lse);
      entropy->push_back(lse - xp);
    }
}

v1::ScoreResponse MustScore(v1::LogprobService::Stub& stub, const v1::ScoreRequest& req) {
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  const grpc::Status st = stub.Score(&ctx, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp;
}

/// Entries of `got` outside docs/SPEC.md's tolerance 2e-4 + 2e-5 |want|,
/// with the first ones described.
std::string OutsideSpec(const std::vector<double>& want, const std::vector<float>& got) {
  if (want.size() != got.size()) return "sizes " + std::to_string(want.size()) + " vs " + std::to_string(got.size());
  std::string out;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= 2e-4 + 2e-5 * std::fabs(want[i])) && ++bad <= 5)
      out += " [" + std::to_string(i) + "] " + std::to_string(got[i]) + " vs " + std::to_string(want[i]);
  return bad ? std::to_string(bad) + " outside:" + out : "";
}

/// The two checkpoint styles of the issue, each with a bias.
struct Style {
  const char* name;
  const char* config;
  DType bias_dtype;
  double w_std;  // logits of std about w_std * 8: large enough to reach the softcap
  double scale, softcap;
};
const Style kGemma2{"gemma2",
                    R"({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 1000,
                        "hidden_size": 64, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                        "tie_word_embeddings": false, "torch_dtype": "bfloat16"})",
                    v1::BF16,
                    3.0,
                    1.0,
                    30.0};
const Style kGranite{"granite",
                     R"({"architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 1000,
                         "hidden_size": 64, "logits_scaling": 8.0, "embedding_multiplier": 12.0,
                         "residual_multiplier": 0.22, "attention_multiplier": 0.0078125})",
                     v1::F32,
                     3.0,
                     0.125,
                     0.0};

class HiddenHeadTransform : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(HiddenHeadTransform, ScoresMatchFloat64AndRowsAreBatchInvariant) {
  const Style& style = std::get<0>(GetParam()) == 0 ? kGemma2 : kGranite;
  const int workers = std::get<1>(GetParam());
  SCOPED_TRACE(std::string(style.name) + ", " + std::to_string(workers) + " workers");
  const std::string dir = TempDir(std::string("head_") + style.name + "_" + std::to_string(workers));
  Head head = WriteCheckpoint(dir, style.config, style.bias_dtype, style.w_std, 17);
  head.scale = style.scale;
  head.softcap = style.softcap;

  auto server = ServerProcess::Start(workers, {"--lm-head", dir, "--hidden-chunk-tokens", "16"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const v1::ServerInfo info = Info(*stub);
  ASSERT_EQ(info.lm_heads_size(), 1);
  EXPECT_TRUE(info.lm_heads(0).has_bias());
  EXPECT_DOUBLE_EQ(info.lm_heads(0).logit_scale(), style.scale);
  EXPECT_DOUBLE_EQ(info.lm_heads(0).final_logit_softcapping(), style.softcap);

  for (const float temperature : {1.0f, 0.7f}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature));
    // Three sequences; the first one alone is the small batch.
    const Batch big = MakeBatch({23, 40, 9}, 5, temperature);
    std::vector<double> want_lp, want_ent;
    Reference(head, big, temperature, &want_lp, &want_ent);
    const v1::ScoreResponse got = MustScore(*stub, big.req);
    const v1::Tensor* lp = FindOutput(got, "token_logprobs");
    const v1::Tensor* ent = FindOutput(got, "entropy");
    ASSERT_TRUE(lp && ent);
    const std::vector<float> got_lp = Floats(*lp), got_ent = Floats(*ent);
    EXPECT_EQ(OutsideSpec(want_lp, got_lp), "") << "token_logprobs";
    EXPECT_EQ(OutsideSpec(want_ent, got_ent), "") << "entropy";
    // The transform must matter here (else the test proves nothing): the
    // untransformed logits give other answers.
    Head plain = head;
    plain.scale = 1;
    plain.softcap = 0;
    std::fill(plain.b.begin(), plain.b.end(), 0.0);
    std::vector<double> plain_lp, plain_ent;
    Reference(plain, big, temperature, &plain_lp, &plain_ent);
    EXPECT_NE(OutsideSpec(plain_lp, got_lp), "");

    // The first sequence alone: bitwise the same as inside the batch.
    Batch small = MakeBatch({23, 40, 9}, 5, temperature);
    const int64_t n = 23;
    small.req.mutable_inputs(0)->set_data(big.req.inputs(0).data().substr(0, n * kH * 2));
    small.req.mutable_inputs(0)->set_shape(0, n);
    small.req.mutable_inputs(1)->set_data(big.req.inputs(1).data().substr(0, n * 8));
    small.req.mutable_inputs(1)->set_shape(0, n);
    const int64_t cu[2] = {0, n};
    *small.req.mutable_inputs(2) = MakeTensor("cu_seqlens", v1::I64, {2}, cu, sizeof cu);
    const v1::ScoreResponse alone = MustScore(*stub, small.req);
    const std::vector<float> alone_lp = Floats(*FindOutput(alone, "token_logprobs"));
    const std::vector<float> alone_ent = Floats(*FindOutput(alone, "entropy"));
    ASSERT_EQ(alone_lp.size(), static_cast<size_t>(n - 1));
    EXPECT_EQ(std::memcmp(alone_lp.data(), got_lp.data(), alone_lp.size() * 4), 0);
    EXPECT_EQ(std::memcmp(alone_ent.data(), got_ent.data(), alone_ent.size() * 4), 0);
  }
  server.reset();
  std::filesystem::remove_all(dir);
}

/// The logits request of `b`: the head's transformed logits softcap(scale
/// * (h W^T + b)) computed in float64 and rounded to float32, same targets.
v1::ScoreRequest AsLogitsRequest(const Head& head, const Batch& b) {
  const int64_t T = static_cast<int64_t>(b.ids.size());
  std::vector<float> z(T * kV);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < kV; ++v) {
      double acc = 0;
      for (int64_t k = 0; k < kH; ++k) acc += b.h[t * kH + k] * head.w[v * kH + k];
      double y = head.scale * (acc + head.b[v]);
      if (head.softcap > 0) y = head.softcap * std::tanh(y / head.softcap);
      z[t * kV + v] = static_cast<float>(y);
    }
  v1::ScoreRequest req = b.req;
  *req.mutable_inputs(0) = MakeTensor("logits", v1::F32, {T, kV}, z.data(), z.size() * 4);
  return req;
}

// Every other output (top-k, gathered ids, sampling filters, which take the
// hidden-states path that exchanges full rows) equals the logits path on
// the transformed logits.
TEST_P(HiddenHeadTransform, EveryOutputMatchesTheLogitsPathOnTransformedLogits) {
  const Style& style = std::get<0>(GetParam()) == 0 ? kGemma2 : kGranite;
  const int workers = std::get<1>(GetParam());
  const std::string dir = TempDir(std::string("head_outputs_") + style.name + "_" + std::to_string(workers));
  Head head = WriteCheckpoint(dir, style.config, style.bias_dtype, style.w_std, 29);
  head.scale = style.scale;
  head.softcap = style.softcap;
  auto server = ServerProcess::Start(workers, {"--lm-head", dir, "--hidden-chunk-tokens", "16"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  Batch outputs = MakeBatch({17, 26}, 11, 0.8f);
  outputs.req.mutable_options()->set_topk(6);
  {
    // Packed: one output row per scored position, T - B of them.
    const int64_t T = static_cast<int64_t>(outputs.ids.size()) - 2, K = 3;
    std::vector<int64_t> ids(T * K);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7919 + 13) % kV);
    *outputs.req.add_inputs() = MakeTensor("gather_indices", v1::I64, {T, K}, ids.data(), ids.size() * 8);
  }
  Batch filters = MakeBatch({17, 26}, 12, 1.0f);
  filters.req.mutable_options()->set_sampling_top_k(50);
  filters.req.mutable_options()->set_sampling_top_p(0.9f);
  for (const Batch* b : {&outputs, &filters}) {
    SCOPED_TRACE(b->req.options().ShortDebugString());
    const v1::ScoreResponse want = MustScore(*stub, AsLogitsRequest(head, *b));
    const v1::ScoreResponse got = MustScore(*stub, b->req);
    ASSERT_EQ(got.outputs_size(), want.outputs_size());
    EXPECT_EQ(
        CompareOutputs({want.outputs().begin(), want.outputs().end()}, {got.outputs().begin(), got.outputs().end()}),
        "");
  }
  server.reset();
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(StylesAndWorkers, HiddenHeadTransform,
                         ::testing::Combine(::testing::Values(0, 1), ::testing::Values(1, 3)), [](const auto& info) {
                           return std::string(std::get<0>(info.param) == 0 ? "Gemma2" : "Granite") + "_" +
                                  std::to_string(std::get<1>(info.param)) + "workers";
                         });

// A bare .safetensors file with the scalars as flags scores exactly as the
// directory whose config.json gives them.
TEST(HiddenHeadTransformFlags, BareFileWithFlagsScoresLikeTheDirectory) {
  const std::string dir = TempDir("head_flags");
  WriteCheckpoint(dir, kGemma2.config, kGemma2.bias_dtype, kGemma2.w_std, 23);
  const Batch batch = MakeBatch({30, 12}, 9, 1.0f);
  auto from_dir = ServerProcess::Start(2, {"--lm-head", dir});
  ASSERT_TRUE(from_dir);
  const v1::ScoreResponse want = MustScore(*from_dir->NewStub(), batch.req);
  from_dir.reset();
  auto from_file = ServerProcess::Start(2, {"--lm-head", dir + "/model.safetensors", "--lm-head-softcap", "30"});
  ASSERT_TRUE(from_file);
  auto stub = from_file->NewStub();
  const v1::ServerInfo info = Info(*stub);
  ASSERT_EQ(info.lm_heads_size(), 1);
  EXPECT_TRUE(info.lm_heads(0).has_bias());  // lm_head.bias from the same file
  EXPECT_EQ(info.lm_heads(0).logit_scale(), 1.0);
  EXPECT_EQ(info.lm_heads(0).final_logit_softcapping(), 30.0);
  const v1::ScoreResponse got = MustScore(*stub, batch.req);
  for (const char* name : {"token_logprobs", "entropy"}) {
    const std::vector<float> a = Floats(*FindOutput(want, name)), b = Floats(*FindOutput(got, name));
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << name;
  }
  from_file.reset();
  std::filesystem::remove_all(dir);
}

// An update of a bare weight file keeps the head's bias and softcap (scored
// against float64 with the new weight), reports them, and `logprob-client
// heads` prints them; an update from a checkpoint folder brings its own bias
// and config.json's scalars.
TEST(HiddenHeadTransformUpdates, AnUpdateKeepsTheHeadsTransformOrBringsItsOwn) {
  const std::string dir = TempDir("head_update"), next_dir = TempDir("head_update_next");
  Head head = WriteCheckpoint(dir, kGemma2.config, kGemma2.bias_dtype, kGemma2.w_std, 41);
  head.scale = kGemma2.scale;
  head.softcap = kGemma2.softcap;
  // The next weight: another checkpoint's, written alone to a bare file.
  const Head next = WriteCheckpoint(next_dir, "{}", v1::F32, kGemma2.w_std, 42);
  {
    auto f = ReadSafetensors(next_dir + "/model.safetensors");
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(WriteSafetensors(next_dir + "/weight.safetensors", {*f->Find("lm_head.weight")}).ok());
  }
  auto server = ServerProcess::Start(2, {"--lm-head", dir, "--allow-lm-head-updates"});
  ASSERT_TRUE(server);
  const std::string client = BinDir() + "/logprob-client ";
  CommandResult r = RunCommand(client + "update-lm-head --server " + server->address() +
                               " --head default --version v2 --input " + next_dir + "/weight.safetensors 2>&1");
  ASSERT_EQ(r.code, 0) << r.output;
  auto stub = server->NewStub();
  const v1::ServerInfo info = Info(*stub);
  ASSERT_EQ(info.lm_heads_size(), 1);
  EXPECT_EQ(info.lm_heads(0).version(), "v2");
  EXPECT_TRUE(info.lm_heads(0).has_bias());
  EXPECT_EQ(info.lm_heads(0).logit_scale(), 1.0);
  EXPECT_EQ(info.lm_heads(0).final_logit_softcapping(), 30.0);

  Head updated = head;
  updated.w = next.w;
  const Batch batch = MakeBatch({21, 14}, 43, 1.0f);
  std::vector<double> want_lp, want_ent;
  Reference(updated, batch, 1.0, &want_lp, &want_ent);
  const v1::ScoreResponse got = MustScore(*stub, batch.req);
  EXPECT_EQ(got.head_version(), "v2");
  EXPECT_EQ(OutsideSpec(want_lp, Floats(*FindOutput(got, "token_logprobs"))), "");
  EXPECT_EQ(OutsideSpec(want_ent, Floats(*FindOutput(got, "entropy"))), "");

  r = RunCommand(client + "heads --server " + server->address() + " 2>&1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("transform bias, final_logit_softcapping 30"), std::string::npos) << r.output;

  // A checkpoint folder as an update: its bias and config.json's scalars
  // go with the weight (Granite-style: logits_scaling 8, no softcap).
  const std::string granite_dir = TempDir("head_update_granite");
  Head granite = WriteCheckpoint(granite_dir, kGranite.config, kGranite.bias_dtype, kGranite.w_std, 44);
  granite.scale = kGranite.scale;
  granite.softcap = kGranite.softcap;
  r = RunCommand(client + "update-lm-head --server " + server->address() + " --head default --version v3 --input " +
                 granite_dir + " 2>&1");
  ASSERT_EQ(r.code, 0) << r.output;
  const v1::ServerInfo info3 = Info(*stub);
  EXPECT_EQ(info3.lm_heads(0).version(), "v3");
  EXPECT_TRUE(info3.lm_heads(0).has_bias());
  EXPECT_EQ(info3.lm_heads(0).logit_scale(), 0.125);
  EXPECT_EQ(info3.lm_heads(0).final_logit_softcapping(), 0.0);
  want_lp.clear();
  want_ent.clear();
  Reference(granite, batch, 1.0, &want_lp, &want_ent);
  const v1::ScoreResponse got3 = MustScore(*stub, batch.req);
  EXPECT_EQ(got3.head_version(), "v3");
  EXPECT_EQ(OutsideSpec(want_lp, Floats(*FindOutput(got3, "token_logprobs"))), "");
  EXPECT_EQ(OutsideSpec(want_ent, Floats(*FindOutput(got3, "entropy"))), "");
  std::filesystem::remove_all(granite_dir);
  server.reset();
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(next_dir);
}

/// Runs logprob-server on `args` (it must exit at start) and returns its
/// exit code and output.
CommandResult StartFails(const std::string& args) {
  return RunCommand("timeout 120 " + BinDir() + "/logprob-server --listen 127.0.0.1:" + std::to_string(FreePort()) +
                    " --workers 1 " + args + " 2>&1");
}

// Issue 50: the transformers golden of heads with a transform and a bias
// (tests/data/golden/make_head_transforms.py: Gemma-2's final-logit
// softcap, Cohere's logit scale; expected values from transformers' own
// forward passes in float64), on 1 and 2 CPU workers (vocabulary slices:
// the bias is sliced with the head). server_cuda_test runs the same cases
// on the GPU (CudaHeadTransformGolden).
TEST(HeadTransformGolden, TransformersForwardPassesOnCpuWorkers) { ExpectTransformGoldensMatch({}); }

TEST(HiddenHeadTransformErrors, UnknownTransformAndContradictingFlagsAreRefusedAtStart) {
  const std::string dir = TempDir("head_refused");
  // Inkling-style: divides the hidden states before the head; not a transform the server knows.
  WriteCheckpoint(dir, R"({"model_type": "inkling", "logits_mup_width_multiplier": 2.0})", v1::F32, 1.0, 3);
  CommandResult r = StartFails("--lm-head " + dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("logits_mup_width_multiplier"), std::string::npos) << r.output;

  // MPT's string logit_scale.
  std::ofstream(dir + "/config.json") << R"({"model_type": "mpt", "logit_scale": "inv_sqrt_d_model"})";
  r = StartFails("--lm-head " + dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("logit_scale is a string, not a number"), std::string::npos) << r.output;
  // The value is the file's content: named by its kind, never echoed.
  EXPECT_EQ(r.output.find("inv_sqrt_d_model"), std::string::npos) << r.output;

  // A flag that contradicts config.json names both.
  std::ofstream(dir + "/config.json") << kGemma2.config;
  r = StartFails("--lm-head " + dir + " --lm-head-softcap 20");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--lm-head-softcap 20"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("final_logit_softcapping"), std::string::npos) << r.output;
  r = StartFails("--lm-head " + dir + " --lm-head-logit-scale 0.5");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--lm-head-logit-scale 0.5"), std::string::npos) << r.output;

  // Flag values themselves.
  r = StartFails("--lm-head " + dir + "/model.safetensors --lm-head-logit-scale -1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--lm-head-logit-scale -1"), std::string::npos) << r.output;

  // config.json says the head has a bias, the checkpoint has none.
  std::ofstream(dir + "/config.json") << R"({"model_type": "phimoe", "lm_head_bias": true})";
  const std::vector<float> w(kV * kH, 0.01f);
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors",
                               {MakeTensor("lm_head.weight", v1::F32, {kV, kH}, w.data(), w.size() * 4)})
                  .ok());
  r = StartFails("--lm-head " + dir);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("lm_head_bias"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace logprob::testing
