// Integration: real servers with 1, 2 and 3 CPU workers on loopback, in
// the token- and vocab-parallel layouts, score every logits golden case;
// every output must match, and results must agree across worker counts
// within float32 rounding and be bitwise independent of batch neighbours.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include "tests/test_support.h"

namespace logprob::testing {
namespace {

using Layout = std::string;

/// Scores every logits golden case on a fresh server; checks each against
/// its expected outputs and returns the responses by case name.
/// `extra`: more server flags.
std::map<std::string, v1::ScoreResponse> ScoreAllGolden(int workers, const std::string& layout,
                                                        const std::vector<std::string>& extra = {}) {
  std::map<std::string, v1::ScoreResponse> out;
  std::vector<std::string> flags = {"--parallelism", layout};
  flags.insert(flags.end(), extra.begin(), extra.end());
  auto server = ServerProcess::Start(workers, flags);
  if (!server) return out;
  auto stub = server->NewStub();
  for (const auto& name : LogitsGoldenNames()) {
    SCOPED_TRACE(name + " workers=" + std::to_string(workers) + " layout=" + layout);
    const GoldenCase c = LoadGolden(name);
    v1::ScoreResponse resp;
    const grpc::Status st = ScoreGolden(*stub, c, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    if (!st.ok()) continue;
    EXPECT_EQ(resp.id(), name);
    const std::vector<v1::Tensor> got(resp.outputs().begin(), resp.outputs().end());
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got), "");
    out[name] = resp;
  }
  return out;
}

class ServerGolden : public ::testing::TestWithParam<std::tuple<int, Layout>> {};

TEST_P(ServerGolden, EveryOutputOfEveryLogitsCaseMatches) {
  const auto [workers, layout] = GetParam();
  EXPECT_EQ(ScoreAllGolden(workers, layout).size(), LogitsGoldenNames().size());
}

INSTANTIATE_TEST_SUITE_P(Workers, ServerGolden,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values("token", "vocab")));

/// Results of 2 and 3 workers agree with 1 worker within float32 rounding.
TEST(ServerAgreement, OneTwoAndThreeWorkersAgree) {
  for (const char* layout : {"token", "vocab"}) {
    const auto ref = ScoreAllGolden(1, layout);
    for (int workers : {2, 3}) {
      const auto got = ScoreAllGolden(workers, layout);
      for (const auto& [name, resp] : ref) {
        SCOPED_TRACE(name + " workers=" + std::to_string(workers) + " layout=" + layout);
        ASSERT_TRUE(got.count(name));
        for (const auto& t : resp.outputs()) {
          const v1::Tensor* g = FindOutput(got.at(name), t.name());
          ASSERT_NE(g, nullptr) << t.name();
          if (t.dtype() != v1::F32) {
            EXPECT_EQ(t.data(), g->data()) << t.name();
            continue;
          }
          const auto a = Floats(t), b = Floats(*g);
          for (size_t i = 0; i < a.size(); ++i) {
            if (std::isinf(a[i])) {
              EXPECT_EQ(a[i], b[i]) << t.name() << "[" << i << "]";
            } else {
              EXPECT_NEAR(a[i], b[i], 4e-6 * (1.0 + std::abs(a[i]))) << t.name() << "[" << i << "]";
            }
          }
        }
      }
    }
  }
}

/// Keeps the first `b` sequences of a padded golden request.
v1::ScoreRequest FirstSequences(const v1::ScoreRequest& full, int64_t b) {
  v1::ScoreRequest req = full;
  for (auto& t : *req.mutable_inputs()) {
    const int64_t B = t.shape(0);
    const size_t per = t.data().size() / static_cast<size_t>(B);
    t.set_shape(0, b);
    t.mutable_data()->resize(per * static_cast<size_t>(b));
  }
  return req;
}

TEST(ServerBatchInvariance, ResultsAreBitwiseIndependentOfOtherRows) {
  for (const char* layout : {"token", "vocab"}) {
    SCOPED_TRACE(layout);
    auto server = ServerProcess::Start(2, {"--parallelism", layout});
    ASSERT_TRUE(server);
    auto stub = server->NewStub();
    for (const char* name : {"basic_f32", "sampling_f32", "top1_ties_bf16"}) {
      const GoldenCase c = LoadGolden(name);
      const v1::ScoreRequest full = GoldenRequest(c);
      const v1::ScoreRequest first = FirstSequences(full, 1);
      v1::ScoreResponse a, b;
      grpc::ClientContext ca, cb;
      ASSERT_TRUE(stub->Score(&ca, full, &a).ok());
      ASSERT_TRUE(stub->Score(&cb, first, &b).ok());
      ASSERT_EQ(a.outputs_size(), b.outputs_size());
      for (int i = 0; i < a.outputs_size(); ++i) {
        const std::string& whole = a.outputs(i).data();
        const std::string& alone = b.outputs(i).data();
        ASSERT_LE(alone.size(), whole.size());
        EXPECT_EQ(whole.substr(0, alone.size()), alone) << name << " " << a.outputs(i).name();
      }
    }
  }
}

/// Payloads reach local workers through shared memory (the default) or
/// inline in the work items (--shared-memory=false, as external workers
/// get them): the same bits either way.
TEST(ServerTransport, SharedMemoryAndInlinePayloadsGiveTheSameBits) {
  for (const char* layout : {"token", "vocab"}) {
    const auto shared = ScoreAllGolden(2, layout);
    const auto inlined = ScoreAllGolden(2, layout, {"--shared-memory=false"});
    ASSERT_EQ(shared.size(), LogitsGoldenNames().size());
    ASSERT_EQ(inlined.size(), shared.size());
    for (const auto& [name, resp] : shared) {
      SCOPED_TRACE(std::string(name) + " layout=" + layout);
      EXPECT_EQ(resp.SerializeAsString(), inlined.at(name).SerializeAsString());
    }
  }
}

/// Shared memory regions are reused (their number does not grow with the
/// requests), all go when the server stops, and regions left by a server
/// that no longer exists are removed when a server starts.
TEST(ServerTransport, SharedMemoryRegionsAreReusedAndRemoved) {
  auto count = [](const std::string& prefix) {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
      if (e.path().filename().string().rfind(prefix, 0) == 0) ++n;
    return n;
  };
  // A region of a process that has exited.
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  const std::string stale = "logprob-" + std::to_string(dead) + "-0";
  std::ofstream(std::string("/dev/shm/") + stale) << "left behind";
  // Modified an hour ago: past the clean-up's one-minute grace for regions
  // whose creator may not hold their lock yet.
  std::filesystem::last_write_time(std::string("/dev/shm/") + stale,
                                   std::filesystem::file_time_type::clock::now() - std::chrono::hours(1));
  ASSERT_EQ(count(stale), 1);

  auto server = ServerProcess::Start(2, {"--parallelism", "vocab"});
  ASSERT_TRUE(server);
  EXPECT_EQ(count(stale), 0) << "the server removes regions of exited processes at start";
  const std::string prefix = "logprob-" + std::to_string(server->pid()) + "-";
  auto stub = server->NewStub();
  for (int round = 0; round < 3; ++round)
    for (const auto& name : LogitsGoldenNames()) {
      v1::ScoreResponse resp;
      ASSERT_TRUE(ScoreGolden(*stub, LoadGolden(name), &resp).ok());
    }
  EXPECT_GE(count(prefix), 1) << "payloads went through shared memory";
  EXPECT_LE(count(prefix), 4) << "regions are reused, at most 4 kept idle";
  EXPECT_EQ(server->SignalAndWait(SIGTERM), 0);
  EXPECT_EQ(count(prefix), 0) << "the server removes its regions when it stops";
}

}  // namespace
}  // namespace logprob::testing
