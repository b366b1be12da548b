// Integration: servers with --backend cuda score every logits golden case
// (1 worker, 2 workers sharing GPUs over Gloo, token- and vocab-parallel;
// NCCL when there are >= 2 GPUs) and the hidden-states golden case with the
// golden lm_head on the GPU. Skips (GTEST_SKIP) without a usable CUDA
// device; checks the clear start-up error instead. CudaIpc: hidden states
// in a cudaMalloc allocation of this process, sent as a CUDA IPC reference
// (Tensor.cuda_ipc), score bitwise as their bytes. CudaFault: a device
// fault injected in the worker re-forms the pool.
#include <cuda_runtime.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/test_support.h"
#include "worker/cuda/device_buffers.h"
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

// Issue 35 item 5: NCCL on a one-GPU machine. A one-rank NCCL pool runs
// the NCCL communicator's own paths (its stream, the event polling whose
// not-ready status must not go stale, AllRanksOk and AgreeOnPass over it),
// which every two-GPU test above skips without.
TEST(CudaGoldenNccl, EveryGoldenCaseMatchesWithNcclOnOneRank) {
  if (Gpus() == 0) GTEST_SKIP() << "no CUDA device";
  ExpectGoldenOn(1, {"--backend", "cuda", "--comm", "nccl", "--parallelism", "vocab"}, /*lm_head=*/true);
}

// Issue 50: the head transform on the GPU against transformers, not only
// against the CPU path: the golden cases of a Gemma-2 head (softcap 30)
// and a Cohere head (logit scale 0.0625), each with a bias
// (tests/data/golden/make_head_transforms.py), on 1 and 2 CUDA workers.
TEST(CudaHeadTransformGolden, TransformersForwardPassesOnTheGpu) {
  if (Gpus() == 0) GTEST_SKIP() << "no CUDA device";
  ExpectTransformGoldensMatch({"--backend", "cuda", "--comm", "gloo"});
}

/// A device allocation of this process holding `bytes` at offset
/// kOffset, exported with cudaIpcGetMemHandle; freed by the destructor.
/// Its size is a whole number of 2 MiB blocks: cudaMalloc may sub-allocate
/// a smaller one from a 2 MiB block, and the importer's mapping
/// (cuMemGetAddressRange) then covers the whole block, so a range past the
/// allocation but inside the block would pass the mapping's check (issue
/// 50); a block of its own is mapped exactly.
class DeviceCopy {
 public:
  static constexpr int64_t kOffset = 256;
  static constexpr size_t kBlock = size_t{2} << 20;
  explicit DeviceCopy(const std::string& bytes) : size_((bytes.size() + 2 * kOffset + kBlock - 1) / kBlock * kBlock) {
    EXPECT_EQ(cudaMalloc(&base_, size_), cudaSuccess);
    EXPECT_EQ(cudaMemset(base_, 0xff, size_), cudaSuccess);  // NaN bf16 around the tensor
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);         // before the upload's own stream writes
    // Landed before the workers (other processes) read it.
    EXPECT_TRUE(cuda::UploadAndWait(static_cast<char*>(base_) + kOffset, bytes.data(), bytes.size()).ok());
    cudaIpcMemHandle_t h;
    EXPECT_EQ(cudaIpcGetMemHandle(&h, base_), cudaSuccess);
    handle_.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  ~DeviceCopy() { cudaFree(base_); }
  const std::string& handle() const { return handle_; }
  int64_t size() const { return static_cast<int64_t>(size_); }

 private:
  void* base_ = nullptr;
  size_t size_;
  std::string handle_;
};

/// `req` with its hidden states replaced by a reference into `copy` at
/// `offset`, saying the allocation has `allocation_bytes` (the Python
/// client sends its size; -1: copy.size(); 0: not sent).
v1::ScoreRequest ByIpc(v1::ScoreRequest req, const DeviceCopy& copy, int64_t offset = DeviceCopy::kOffset,
                       int64_t allocation_bytes = -1) {
  for (v1::Tensor& t : *req.mutable_inputs())
    if (t.name() == "hidden_states") {
      // data and cuda_ipc share a oneof: the size is read before cuda_ipc clears data.
      const auto byte_size = static_cast<int64_t>(t.data().size());
      t.mutable_cuda_ipc()->set_handle(copy.handle());
      t.mutable_cuda_ipc()->set_offset(offset);
      t.mutable_cuda_ipc()->set_byte_size(byte_size);
      t.mutable_cuda_ipc()->set_allocation_bytes(allocation_bytes < 0 ? copy.size() : allocation_bytes);
    }
  return req;
}

/// The bytes of `req`'s hidden_states tensor ("" without one).
std::string HiddenBytes(const v1::ScoreRequest& req) {
  for (const auto& t : req.inputs())
    if (t.name() == "hidden_states") return t.data();
  return "";
}

std::string OutputBytes(const v1::ScoreResponse& r) {
  std::string s;
  for (const auto& t : r.outputs()) s += t.SerializeAsString();
  return s;
}

/// A server of `workers` CUDA workers over `comm` scores hidden_bf16 by
/// CUDA IPC: the golden outputs; with every row scored, bitwise the bytes
/// request; a range past the allocation is INVALID_ARGUMENT.
void ExpectIpcBitwise(int workers, const std::string& comm) {
  auto server = ServerProcess::Start(
      workers, {"--backend", "cuda", "--comm", comm, "--lm-head", GoldenDir() + "/hidden_bf16.lm_head.safetensors"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
    EXPECT_TRUE(info.cuda_ipc_inputs());
  }
  const GoldenCase c = LoadGolden("hidden_bf16");
  const v1::ScoreRequest bytes_req = GoldenRequest(c);
  const std::string hidden = HiddenBytes(bytes_req);
  ASSERT_FALSE(hidden.empty());
  DeviceCopy copy(hidden);
  auto score = [&](const v1::ScoreRequest& req, v1::ScoreResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    return stub->Score(&ctx, req, resp);
  };
  // The golden alignment matches the expected outputs.
  v1::ScoreResponse got;
  grpc::Status st = score(ByIpc(bytes_req, copy), &got);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(CompareOutputs(c.expected.tensors, {got.outputs().begin(), got.outputs().end()}), "");
  // Every row scored (same_position): the IPC request multiplies the same
  // rows as the bytes request, bitwise the same outputs.
  v1::ScoreRequest all = bytes_req;
  all.mutable_options()->set_alignment(v1::SAME_POSITION);
  v1::ScoreResponse want;
  st = score(all, &want);
  ASSERT_TRUE(st.ok()) << st.error_message();
  st = score(ByIpc(all, copy), &got);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(OutputBytes(got), OutputBytes(want));
  // A range past the allocation's end, each check with its own message,
  // and the server goes on after each:
  const int64_t past = copy.size() - DeviceCopy::kOffset + 2;
  auto refused = [&](const v1::ScoreRequest& req, const std::string& says) {
    v1::ScoreResponse r;
    const grpc::Status s = score(req, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(says), std::string::npos) << s.error_message();
  };
  // with the allocation's size sent: the front-end's check;
  refused(ByIpc(all, copy, past), "(allocation_bytes)");
  // without it: the workers' check against their mapping, exact for an
  // allocation of whole 2 MiB blocks;
  refused(ByIpc(all, copy, past, 0), "outside the client's allocation of " + std::to_string(copy.size()) +
                                         " bytes (as mapped here; the client sent no size)");
  // a size larger than the mapping: the client's figure is not trusted.
  refused(ByIpc(all, copy, DeviceCopy::kOffset, copy.size() + static_cast<int64_t>(DeviceCopy::kBlock)),
          "the client says its allocation has " + std::to_string(copy.size() + DeviceCopy::kBlock) +
              " bytes, but the mapping of its handle has " + std::to_string(copy.size()));
  st = score(ByIpc(all, copy), &got);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(OutputBytes(got), OutputBytes(want));
}

TEST(CudaIpc, OneWorkerIsBitwiseTheBytes) {
  if (Gpus() == 0) GTEST_SKIP() << "no CUDA device";
  ExpectIpcBitwise(1, "gloo");
}

TEST(CudaIpc, TwoWorkersOverNcclAreBitwiseTheBytes) {
  if (Gpus() < 2) GTEST_SKIP() << "needs 2 CUDA devices, have " << Gpus();
  ExpectIpcBitwise(2, "nccl");
}

TEST(CudaIpc, OneRankOverNcclIsBitwiseTheBytes) {
  if (Gpus() == 0) GTEST_SKIP() << "no CUDA device";
  ExpectIpcBitwise(1, "nccl");
}

TEST(CudaIpc, TwoWorkersOverGlooOnOneGpuAreBitwiseTheBytes) {
  // Gloo's device collectives are staged through host memory
  // (worker/comm/host_staged_device_collectives.h): two workers may share one
  // GPU and still score a device pointer in one pass.
  if (Gpus() == 0) GTEST_SKIP() << "no CUDA device";
  ExpectIpcBitwise(2, "gloo");
}

// Issue 35 item 2: a device fault (the LOGPROB_TEST_TRAP_FILE hook: a
// kernel executing __trap() before a GEMM, a sticky error) fails that
// request with UNAVAILABLE instead of leaving a worker that fails every
// request with INTERNAL; the pool re-forms with a fresh worker process and
// the request after it scores the golden outputs again.
TEST(CudaFault, TheRequestAfterADeviceFaultSucceedsOnceThePoolReformed) {
  if (Gpus() == 0) GTEST_SKIP() << "no CUDA device";
  const std::string trap = ::testing::TempDir() + "cuda_fault_trap." + std::to_string(getpid());
  std::remove(trap.c_str());
  const int metrics_port = FreePort();
  // Read by the workers when they start (ServerProcess passes this
  // process's environment on, the server to its workers).
  ASSERT_EQ(setenv("LOGPROB_TEST_TRAP_FILE", trap.c_str(), 1), 0);
  auto server =
      ServerProcess::Start(1, {"--backend", "cuda", "--lm-head", GoldenDir() + "/hidden_bf16.lm_head.safetensors",
                               "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port)});
  unsetenv("LOGPROB_TEST_TRAP_FILE");
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const GoldenCase c = LoadGolden("hidden_bf16");
  v1::ScoreResponse resp;
  grpc::Status st = ScoreGolden(*stub, c, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(CompareOutputs(c.expected.tensors, {resp.outputs().begin(), resp.outputs().end()}), "");
  const std::vector<pid_t> before = server->WorkerPids();
  ASSERT_EQ(before.size(), 1u);

  { std::ofstream(trap) << "trap once\n"; }
  st = ScoreGolden(*stub, c, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_FALSE(std::filesystem::exists(trap));  // the worker took it
  ASSERT_TRUE(WaitForMetric(metrics_port, "logprob_worker_restarts_total", 1));
  // The request after the fault, once the re-formed pool serves.
  ASSERT_TRUE(WaitUntil("a request succeeds after the pool re-formed", [&] {
    resp.Clear();
    return ScoreGolden(*stub, c, &resp).ok();
  }));
  EXPECT_EQ(CompareOutputs(c.expected.tensors, {resp.outputs().begin(), resp.outputs().end()}), "");
  const std::vector<pid_t> after = server->WorkerPids();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_NE(after[0], before[0]);  // a fresh process, with a working context
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
