// Integration: servers with --backend cuda score every logits golden case
// (1 worker, 2 workers sharing GPUs over Gloo, token- and vocab-parallel;
// NCCL when there are >= 2 GPUs) and the hidden-states golden case with the
// golden lm_head on the GPU. Skips (GTEST_SKIP) without a usable CUDA
// device; checks the clear start-up error instead.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <tuple>

#include "tests/test_support.h"
#include "worker/cuda/device_info.h"

namespace logprob::testing {
namespace {

int Gpus() {
  auto n = cuda::DeviceCount();
  return n.ok() ? *n : 0;
}

/// Every logits golden case (and hidden_bf16 when `lm_head`) on a server
/// started with `flags` matches its expected outputs.
void ExpectGoldenOn(int workers, const std::vector<std::string>& flags, bool lm_head) {
  std::vector<std::string> all = flags;
  if (lm_head) {
    all.push_back("--lm-head");
    all.push_back(GoldenDir() + "/hidden_bf16.lm_head.safetensors");
  }
  auto server = ServerProcess::Start(workers, all);
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  std::vector<std::string> names = LogitsGoldenNames();
  if (lm_head) names.push_back("hidden_bf16");
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    const GoldenCase c = LoadGolden(name);
    v1::ScoreResponse resp;
    const grpc::Status st = ScoreGolden(*stub, c, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    const std::vector<v1::Tensor> got(resp.outputs().begin(), resp.outputs().end());
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got), "");
  }
}

class CudaGolden : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(CudaGolden, EveryGoldenCaseMatchesWithGloo) {
  if (Gpus() == 0) GTEST_SKIP() << "no CUDA device";
  const auto [workers, layout] = GetParam();
  ExpectGoldenOn(workers, {"--backend", "cuda", "--comm", "gloo", "--parallelism", layout}, /*lm_head=*/true);
}

INSTANTIATE_TEST_SUITE_P(Workers, CudaGolden,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values("token", "vocab")));

TEST(CudaGoldenNccl, EveryGoldenCaseMatchesWithNcclOnTwoGpus) {
  if (Gpus() < 2) GTEST_SKIP() << "needs 2 CUDA devices, have " << Gpus();
  ExpectGoldenOn(2, {"--backend", "cuda", "--comm", "nccl", "--parallelism", "vocab"}, /*lm_head=*/true);
}

TEST(CudaFlags, NcclWithoutCudaAndUnknownBackendAreRefused) {
  const std::string server = BinDir() + "/logprob-server --listen 127.0.0.1:0 ";
  auto r = RunCommand(server + "--backend cpu --comm nccl 2>&1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("--comm nccl needs --backend cuda"), std::string::npos) << r.output;
  r = RunCommand(server + "--backend tpu 2>&1");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.output.find("--backend tpu: must be cpu or cuda"), std::string::npos) << r.output;
}

TEST(CudaFlags, WithoutAGpuTheServerExitsWithTheWorkersReason) {
  if (Gpus() > 0) GTEST_SKIP() << "a CUDA device is present";
  const auto r =
      RunCommand(BinDir() + "/logprob-server --listen 127.0.0.1:0 --worker-join-timeout 5 --backend cuda 2>&1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("CUDA device"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace logprob::testing
