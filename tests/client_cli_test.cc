// The command-line contract (docs/SPEC.md) end to end: logprob-client
// against a live 2-worker server (with the golden lm_head) scores every
// golden case, logits and hidden states, into an output file that matches,
// also when requests are split; health and error exits.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace logprob::testing
