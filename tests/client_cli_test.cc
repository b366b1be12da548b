// The command-line contract (docs/SPEC.md) end to end: logprob-client
// against a live 2-worker server (with the golden lm_head) scores every
// golden case, logits and hidden states, into an output file that matches,
// also when requests are split; health and error exits; --server checks;
// --version of the three programs; --head / --head-version against a
// server with two heads.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

CommandResult RunClient(const std::string& args) { return RunCommand(BinDir() + "/logprob-client " + args); }

class ClientCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = ServerProcess::Start(2, {"--lm-head", GoldenDir() + "/hidden_bf16.lm_head.safetensors"}).release();
  }
  static void TearDownTestSuite() { delete server_; }
  /// Output path unique to this test (ctest runs tests in parallel processes).
  std::string Out(const std::string& name) {
    return ::testing::TempDir() + "/" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "." + name +
           ".out.safetensors";
  }
  static ServerProcess* server_;
};
ServerProcess* ClientCli::server_ = nullptr;

TEST_F(ClientCli, HealthReportsServing) {
  ASSERT_TRUE(server_);
  EXPECT_EQ(RunClient("health --server " + server_->address() + " --wait 5").code, 0);
  const CommandResult dead = RunClient("health --server 127.0.0.1:" + std::to_string(FreePort()) + " --wait 1");
  EXPECT_NE(dead.code, 0) << dead.output;
}

TEST_F(ClientCli, ScoresEveryLogitsGoldenCase) {
  ASSERT_TRUE(server_);
  for (const auto& name : LogitsGoldenNames()) {
    SCOPED_TRACE(name);
    const GoldenCase c = LoadGolden(name);
    const CommandResult r = RunClient("score --server " + server_->address() + " --input " + GoldenDir() + "/" + name +
                                      ".safetensors --output " + Out(name) + CliOptionFlags(c));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("token_logprobs"), std::string::npos) << r.output;
    // The summary counts the positions that got a score: those of the
    // expected token_logprobs that are not 0 (padding, ignored targets).
    const v1::Tensor* want = c.expected.Find("token_logprobs");
    ASSERT_NE(want, nullptr);
    int64_t scored = 0, rows = 1;
    for (size_t i = 0; i < want->data().size() / sizeof(float); ++i) {
      float v;
      std::memcpy(&v, want->data().data() + i * sizeof(float), sizeof v);
      scored += v != 0.0f ? 1 : 0;
    }
    const v1::Tensor* logits = c.inputs.Find("logits");
    ASSERT_NE(logits, nullptr);
    for (int d = 0; d + 1 < logits->shape_size(); ++d) rows *= logits->shape(d);
    EXPECT_NE(r.output.find(absl::StrCat("scored ", scored, " tokens (of ", rows, " input rows) in ")),
              std::string::npos)
        << r.output;
    auto got = ReadSafetensors(Out(name));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got->tensors), "");
  }
}

TEST_F(ClientCli, SplitsRequestsOverTheMessageLimit) {
  ASSERT_TRUE(server_);
  // Limits that leave room for one or two sequences per request.
  for (const auto& [name, limit] : std::vector<std::pair<std::string, int>>{
           {"llama_vocab_bf16", 7000000}, {"packed_bf16", 500000}, {"odd_vocab_f16", 7000000}}) {
    SCOPED_TRACE(name);
    const GoldenCase c = LoadGolden(name);
    const CommandResult r = RunClient("score --server " + server_->address() + " --input " + GoldenDir() + "/" + name +
                                      ".safetensors --output " + Out(name) + CliOptionFlags(c) +
                                      " --max-request-bytes " + std::to_string(limit));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("part 2/"), std::string::npos) << r.output;
    auto got = ReadSafetensors(Out(name));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got->tensors), "");
  }
}

TEST_F(ClientCli, ScoresHiddenStatesWholeAndSplit) {
  ASSERT_TRUE(server_);
  const GoldenCase c = LoadGolden("hidden_bf16");
  for (const char* split : {"", " --max-request-bytes 20000"}) {
    SCOPED_TRACE(split);
    const CommandResult r = RunClient("score --server " + server_->address() + " --input " + GoldenDir() +
                                      "/hidden_bf16.safetensors --output " + Out("hidden") + CliOptionFlags(c) + split);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output.find("part 2/") != std::string::npos, *split != '\0') << r.output;
    auto got = ReadSafetensors(Out("hidden"));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got->tensors), "");
  }
}

TEST_F(ClientCli, MalformedInputFileIsAClearError) {
  ASSERT_TRUE(server_);
  const std::string bad = ::testing::TempDir() + "/bad.safetensors";
  std::ofstream(bad, std::ios::binary) << std::string("\xff\x00\x00\x00\x00\x00\x00\x00{not json", 17);
  const CommandResult r =
      RunClient("score --server " + server_->address() + " --input " + bad + " --output " + Out("bad"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("malformed safetensors"), std::string::npos) << r.output;
}

TEST_F(ClientCli, ServerErrorExitsNonZeroWithItsMessage) {
  ASSERT_TRUE(server_);
  const CommandResult r = RunClient("score --server " + server_->address() + " --input " + GoldenDir() +
                                    "/basic_f32.safetensors --output " + Out("err") + " --topk 5000");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("INVALID_ARGUMENT"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("options.topk"), std::string::npos) << r.output;
}

TEST_F(ClientCli, ServerFlagSlipsSayWhatToChange) {
  // The Python client's rules (channel.check_target), before any connection.
  for (const auto& [server, says] : std::vector<std::pair<std::string, std::string>>{
           {"http://127.0.0.1:50051",
            "--server 'http://127.0.0.1:50051': drop the scheme, give 'HOST:PORT' such as "
            "'127.0.0.1:50051'"},
           {"https://scorer.example:443", "(for TLS pass --tls-ca FILE"},
           {"127.0.0.1", "--server '127.0.0.1': add the port, e.g. '127.0.0.1:50051'"},
           {"[::1]", "add the port, e.g. '[::1]:50051'"},
           {"::1:50051", "put an IPv6 address in brackets, e.g. '[::1]:50051'"},
           {"127.0.0.1:0", "the port must be a number in 1..65535, got '0'"},
           {"127.0.0.1:http", "the port must be a number in 1..65535, got 'http'"},
           {":50051", "add the host, e.g. '127.0.0.1:50051'"}}) {
    SCOPED_TRACE(server);
    for (const char* command : {"health", "score --input x --output y", "heads"}) {
      const CommandResult r = RunClient(std::string(command) + " --server '" + server + "'");
      EXPECT_EQ(r.code, 2) << r.output;
      EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
    }
  }
  // Accepted: HOST:PORT, [V6]:PORT and resolver URIs reach the connection
  // (nothing listens there: health fails with 1, not a command-line 2).
  const std::string port = std::to_string(FreePort());
  for (const std::string& server : {"127.0.0.1:" + port, "[::1]:" + port, "dns:///127.0.0.1:" + port,
                                    std::string("unix:/nonexistent/logprob.sock")}) {
    const CommandResult r = RunClient("health --server " + server);
    EXPECT_EQ(r.code, 1) << server << ": " << r.output;
  }
  ASSERT_TRUE(server_);
  EXPECT_EQ(RunClient("health --server ' " + server_->address() + " '").code, 0);  // whitespace trimmed
}

/// `PROGRAM --version` exits 0 and prints "PROGRAM <VERSION>" and the
/// CUDA line of this build (common/version.h VersionText).
void ExpectVersion(const std::string& program) {
  const CommandResult r = RunCommand(BinDir() + "/" + program + " --version");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, VersionText(program.c_str())) << r.output;
  EXPECT_EQ(r.output.rfind(absl::StrCat(program, " ", kVersion, "\nCUDA backend: "), 0), 0u) << r.output;
  EXPECT_NE(r.output.find(kBuiltWithCuda ? "CUDA backend: yes (CUDA toolkit " : "CUDA backend: no"), std::string::npos)
      << r.output;
}

TEST(ClientCliVersion, ServerPrintsTheVersionAndWhetherTheBuildHasCuda) { ExpectVersion("logprob-server"); }
TEST(ClientCliVersion, WorkerPrintsTheVersionAndWhetherTheBuildHasCuda) { ExpectVersion("logprob-worker"); }
TEST(ClientCliVersion, ClientPrintsTheVersionAndWhetherTheBuildHasCuda) {
  ExpectVersion("logprob-client");
  // After a command --version is not this flag (it is update-lm-head's version name).
  const CommandResult r = RunClient("health --server 127.0.0.1:1 --version 1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("health: unknown flag --version"), std::string::npos) << r.output;
}

// A misspelled flag is named as unknown (last on the line, or followed by
// another flag), not as a flag that "needs a value"; a usage error is the
// error and a pointer to --help, not buried under the usage.
TEST(ClientCliUsage, AMisspelledFlagIsUnknownAndTheErrorIsNotBuried) {
  for (const char* tail : {" --entropyy", " --entropyy --topk 5"}) {
    const CommandResult r = RunClient(std::string("score --server 127.0.0.1:1 --input a --output b") + tail);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("error: score: unknown flag --entropyy"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("needs a value"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("logprob-client --help"), std::string::npos) << r.output;
    EXPECT_LT(std::count(r.output.begin(), r.output.end(), '\n'), 4) << r.output;
  }
  // A known flag without its value still says so.
  const CommandResult r = RunClient("score --server 127.0.0.1:1 --input a --output b --topk");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("score: --topk needs a value"), std::string::npos) << r.output;
}

// A server with two lm_heads, "policy" (the golden head, then updated to
// v2 = a random head) and "reference" (that random head): --head and
// --head-version choose what scores the hidden states.
class ClientCliHeads : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = ::testing::TempDir() + "/client_cli_heads." + std::to_string(getpid());
    ASSERT_EQ(RunCommand("mkdir -p " + dir).code, 0);
    golden_head_ = GoldenDir() + "/hidden_bf16.lm_head.safetensors";
    auto golden = ReadSafetensors(golden_head_);
    ASSERT_TRUE(golden.ok()) << golden.status();
    const v1::Tensor& w = golden->tensors.at(0);
    ASSERT_EQ(w.shape_size(), 2);
    vocab_ = w.shape(0);
    hidden_ = w.shape(1);
    random_head_ = dir + "/random.safetensors";
    ASSERT_TRUE(WriteRandomLmHead(random_head_, vocab_, hidden_, 7).ok());
    server_ = ServerProcess::Start(2, {"--lm-head", "policy=" + golden_head_, "--lm-head", "reference=" + random_head_,
                                       "--allow-lm-head-updates", "--lm-head-retain", "2"})
                  .release();
    ASSERT_TRUE(server_);
    const CommandResult up = RunClient("update-lm-head --server " + server_->address() +
                                       " --head policy --version v2 --input " + random_head_);
    ASSERT_EQ(up.code, 0) << up.output;
  }
  static void TearDownTestSuite() { delete server_; }
  std::string Out(const std::string& name) {
    return ::testing::TempDir() + "/" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "." + name +
           ".out.safetensors";
  }
  /// `score` of the golden hidden-states case with `flags`.
  CommandResult Score(const std::string& out, const std::string& flags) {
    return RunClient("score --server " + server_->address() + " --input " + GoldenDir() +
                     "/hidden_bf16.safetensors --output " + out + CliOptionFlags(LoadGolden("hidden_bf16")) + " " +
                     flags);
  }
  static ServerProcess* server_;
  static std::string golden_head_, random_head_;
  static int64_t vocab_, hidden_;
};
ServerProcess* ClientCliHeads::server_ = nullptr;
std::string ClientCliHeads::golden_head_, ClientCliHeads::random_head_;
int64_t ClientCliHeads::vocab_ = 0, ClientCliHeads::hidden_ = 0;

TEST_F(ClientCliHeads, ServerInfoGivesEveryHeadsShape) {
  ASSERT_TRUE(server_);
  auto stub = server_->NewStub();
  grpc::ClientContext context;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&context, v1::ServerInfoRequest(), &info).ok());
  ASSERT_EQ(info.lm_heads_size(), 2);
  for (const v1::LmHeadInfo& h : info.lm_heads()) {
    SCOPED_TRACE(h.name());
    EXPECT_EQ(h.vocab_size(), vocab_);
    EXPECT_EQ(h.hidden_size(), hidden_);
  }
  EXPECT_EQ(info.lm_heads(0).name(), "policy");
  EXPECT_EQ(info.lm_heads(0).version(), "v2");
  EXPECT_EQ(info.lm_heads(0).retained_versions_size(), 2);
  // No head "default": the top-level fields give the shape all heads share,
  // and no single head's file, dtype or precision.
  EXPECT_EQ(info.vocab_size(), vocab_);
  EXPECT_EQ(info.hidden_size(), hidden_);
  EXPECT_EQ(info.lm_head_path(), "");
  EXPECT_EQ(info.lm_head_precision(), "");
}

TEST_F(ClientCliHeads, HeadAndPinnedVersionChooseTheWeights) {
  ASSERT_TRUE(server_);
  const GoldenCase c = LoadGolden("hidden_bf16");
  // policy@initial is the golden head: the float64 expectation, whole, split
  // into parts (every part pinned) and in pieces (ScoreChunked).
  for (const char* how : {"", "--max-request-bytes 20000", "--chunk-above 1 --piece-bytes 4096"}) {
    SCOPED_TRACE(how);
    const CommandResult r = Score(Out("initial"), std::string("--head policy --head-version initial ") + how);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("lm_head policy version initial"), std::string::npos) << r.output;
    auto got = ReadSafetensors(Out("initial"));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got->tensors), "");
  }
  // policy's current version (v2) and reference hold the same weights: the
  // same bytes, and not the golden head's answer.
  CommandResult r = Score(Out("policy"), "--head policy --max-request-bytes 20000");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("lm_head policy version v2"), std::string::npos) << r.output;
  r = Score(Out("reference"), "--head=reference");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("lm_head reference version initial"), std::string::npos) << r.output;
  auto policy = ReadSafetensors(Out("policy"));
  auto reference = ReadSafetensors(Out("reference"));
  ASSERT_TRUE(policy.ok() && reference.ok());
  EXPECT_EQ(CompareOutputs(reference->tensors, policy->tensors), "");
  const v1::Tensor* lp = policy->Find("token_logprobs");
  ASSERT_NE(lp, nullptr);
  const v1::Tensor* want = c.expected.Find("token_logprobs");
  ASSERT_NE(want, nullptr);
  ASSERT_EQ(lp->data().size(), want->data().size());
  EXPECT_NE(lp->data(), want->data());
}

TEST_F(ClientCliHeads, UnknownHeadOrVersionIsTheServersErrorAndExitsOne) {
  ASSERT_TRUE(server_);
  CommandResult r = Score(Out("nope"), "--head nope");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("NOT_FOUND"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("head \"nope\": the server holds no such lm_head; it holds: policy, reference"),
            std::string::npos)
      << r.output;
  r = Score(Out("gone"), "--head policy --head-version gone");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("FAILED_PRECONDITION"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("head_version \"gone\": lm_head \"policy\" does not hold this version"), std::string::npos)
      << r.output;
  // Without --head the server has no "default" head to use.
  r = Score(Out("none"), "");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("the server has no head \"default\""), std::string::npos) << r.output;
  // A logits file has no lm_head to choose: a command-line error, nothing sent.
  r = RunClient("score --server " + server_->address() + " --input " + GoldenDir() +
                "/basic_f32.safetensors --output " + Out("logits") + " --head policy");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--head / --head-version select the lm_head"), std::string::npos) << r.output;
  r = RunClient("score --server " + server_->address() + " --input x --output y --head=");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--head: '' is not an lm_head name"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace logprob::testing
