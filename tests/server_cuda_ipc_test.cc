// CUDA IPC inputs (Tensor.cuda_ipc; server/inputs/cuda_ipc_inputs.h) on CPU:
// - ResolveInputs / ResolveCudaIpc: INVALID_ARGUMENT naming the tensor for
//   a reference on another tensor than hidden_states, a handle that is not
//   64 bytes, a negative or misaligned offset, a byte_size that does not
//   match the shape; FAILED_PRECONDITION with sampling filters; the source
//   refers workers to byte ranges and is never read;
// - CheckCudaIpcAvailable: FAILED_PRECONDITION saying why (flag off, CPU
//   workers, remote workers, remote peer) and to send bytes instead;
// - BuildScoreJob + PlanWork + BuildResponse: a padded next_token job
//   becomes every input row; each worker's item carries the handle and its
//   contiguous byte range and no bytes; unscored rows' results are dropped
//   and scored rows land at their output positions; two CUDA IPC jobs are
//   never batched together;
// - a live CPU server: ServerInfo.cuda_ipc_inputs false, references refused
//   with FAILED_PRECONDITION (or INVALID_ARGUMENT when malformed; Score and
//   ScoreChunked), the
//   flag's message with --cuda-ipc-inputs=false.
// The GPU path (a real allocation through a --backend cuda server) is in
// server_cuda_test (CudaIpc) and client/python/tests/test_cuda_ipc.py.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "client/chunked_call.h"
#include "common/partition.h"
#include "server/core/batcher.h"
#include "server/core/planner.h"
#include "server/core/response_builder.h"
#include "server/core/score_job.h"
#include "server/inputs/cuda_ipc_inputs.h"
#include "server/inputs/request_inputs.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int64_t kH = 4, kV = 16;

v1::Tensor IntTensor(const std::string& name, const std::vector<int64_t>& shape, const std::vector<int64_t>& v) {
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(v1::I64);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(v.data(), v.size() * sizeof(int64_t));
  return t;
}

/// hidden_states [B, S, kH] F32 by CUDA IPC (handle of 64 'h'), offset 256,
/// plus input_ids and seq_lens.
v1::ScoreRequest IpcRequest(int64_t B, int64_t S, const std::vector<int64_t>& ids,
                            const std::vector<int64_t>& seq_lens) {
  v1::ScoreRequest req;
  v1::Tensor* h = req.add_inputs();
  h->set_name("hidden_states");
  h->set_dtype(v1::F32);
  h->add_shape(B);
  h->add_shape(S);
  h->add_shape(kH);
  h->mutable_cuda_ipc()->set_handle(std::string(64, 'h'));
  h->mutable_cuda_ipc()->set_offset(256);
  h->mutable_cuda_ipc()->set_byte_size(B * S * kH * 4);
  *req.add_inputs() = IntTensor("input_ids", {B, S}, ids);
  if (!seq_lens.empty()) *req.add_inputs() = IntTensor("seq_lens", {B}, seq_lens);
  return req;
}

/// A context in which CUDA IPC inputs are available, for a local peer.
InputContext IpcContext() {
  InputContext c;
  c.cuda_ipc = CudaIpcAvailability{
      /*flag=*/true, /*cuda_workers=*/true, /*same_host=*/true, /*one_pass=*/true, 1, "gloo"};
  c.peer = "ipv4:127.0.0.1:5000";
  return c;
}

absl::Status ResolveStatus(const v1::ScoreRequest& req) { return ResolveInputs(req, IpcContext()).status(); }

TEST(ResolveCudaIpc, MalformedReferencesNameTheTensor) {
  const v1::ScoreRequest good = IpcRequest(1, 3, {1, 2, 3}, {});
  auto resolved = ResolveInputs(good, IpcContext());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  ASSERT_EQ(resolved->sources.size(), 2u);
  EXPECT_EQ(resolved->sources[0]->kind(), InputKind::kCudaIpc);
  EXPECT_EQ(resolved->sources[0]->byte_size(), 3 * kH * 4);
  EXPECT_EQ(resolved->sources[1]->kind(), InputKind::kBytes);
  EXPECT_EQ(resolved->referenced_bytes, 3 * kH * 4);
  // The reference: bytes [8, 8 + 16) of the tensor are [264, 280) of the allocation.
  internal::v1::WorkItem item;
  ASSERT_TRUE(resolved->sources[0]->Refer(8, 16, &item));
  EXPECT_EQ(item.cuda_ipc().handle(), std::string(64, 'h'));
  EXPECT_EQ(item.cuda_ipc().offset(), 256 + 8);
  EXPECT_EQ(item.cuda_ipc().byte_size(), 16);
  EXPECT_EQ(item.cuda_ipc().allocation_bytes(), 0);  // not given
  // The allocation's size the client sent travels to the workers; a range
  // that ends exactly at its end is accepted.
  v1::ScoreRequest sized = good;
  sized.mutable_inputs(0)->mutable_cuda_ipc()->set_allocation_bytes(256 + 48);
  auto sized_resolved = ResolveInputs(sized, IpcContext());
  ASSERT_TRUE(sized_resolved.ok()) << sized_resolved.status();
  internal::v1::WorkItem sized_item;
  ASSERT_TRUE(sized_resolved->sources[0]->Refer(8, 16, &sized_item));
  EXPECT_EQ(sized_item.cuda_ipc().allocation_bytes(), 256 + 48);
  // The front-end never reads it.
  std::string bytes(4, 'x');
  EXPECT_FALSE(resolved->sources[0]->Read(0, 4, bytes.data()));
  EXPECT_EQ(bytes, std::string(4, '\0'));
  // Tensor.source is one of: data replaces the reference.
  v1::ScoreRequest plain = good;
  plain.mutable_inputs(0)->set_data(std::string(48, '\0'));
  EXPECT_FALSE(plain.inputs(0).has_cuda_ipc());
  resolved = ResolveInputs(plain, InputContext{});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->sources[0]->kind(), InputKind::kBytes);
  EXPECT_EQ(resolved->referenced_bytes, 0);

  struct Case {
    std::function<void(v1::ScoreRequest*)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::ScoreRequest* r) { r->mutable_inputs(0)->mutable_cuda_ipc()->set_handle(std::string(63, 'h')); },
       "inputs[0] \"hidden_states\": cuda_ipc.handle is 63 bytes; a cudaIpcMemHandle_t is 64"},
      {[](v1::ScoreRequest* r) { r->mutable_inputs(0)->mutable_cuda_ipc()->set_handle(""); },
       "cuda_ipc.handle is 0 bytes"},
      {[](v1::ScoreRequest* r) { r->mutable_inputs(0)->mutable_cuda_ipc()->set_byte_size(47); },
       "cuda_ipc.byte_size is 47 but the shape of F32 needs 48"},
      {[](v1::ScoreRequest* r) { r->mutable_inputs(0)->mutable_cuda_ipc()->set_offset(-4); },
       "offset -4, byte_size 48 and allocation_bytes 0 must be >= 0"},
      {[](v1::ScoreRequest* r) { r->mutable_inputs(0)->mutable_cuda_ipc()->set_allocation_bytes(-1); },
       "allocation_bytes -1 must be >= 0"},
      {[](v1::ScoreRequest* r) { r->mutable_inputs(0)->mutable_cuda_ipc()->set_allocation_bytes(256 + 47); },
       "inputs[0] \"hidden_states\": cuda_ipc: bytes [256, 256 + 48) are outside the allocation of 303 bytes "
       "(allocation_bytes)"},
      {[](v1::ScoreRequest* r) { r->mutable_inputs(0)->mutable_cuda_ipc()->set_offset(6); },
       "cuda_ipc.offset 6 is not a multiple of F32's 4 bytes"},
      {[](v1::ScoreRequest* r) {
         v1::Tensor* ids = r->mutable_inputs(1);
         ids->mutable_cuda_ipc()->set_handle(std::string(64, 'h'));
         ids->mutable_cuda_ipc()->set_byte_size(24);
       },
       "inputs[1] \"input_ids\": a CUDA IPC reference is only accepted for \"hidden_states\""},
  };
  for (const Case& c : cases) {
    v1::ScoreRequest bad = good;
    c.edit(&bad);
    const absl::Status st = ResolveStatus(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_NE(st.message().find(c.message), std::string::npos) << st.message() << "\nwant: " << c.message;
  }
}

TEST(CheckCudaIpcAvailable, SaysWhyAndWhatToSendInstead) {
  CudaIpcAvailability a{/*flag=*/true, /*cuda_workers=*/true, /*same_host=*/true, /*one_pass=*/true, 1,
                        "gloo"};
  EXPECT_TRUE(a.available());
  EXPECT_TRUE(CheckCudaIpcAvailable(a, "ipv4:127.0.0.1:5000").ok());
  EXPECT_TRUE(CheckCudaIpcAvailable(a, "ipv6:[::1]:5000").ok());
  EXPECT_TRUE(CheckCudaIpcAvailable(a, "unix:/tmp/s").ok());
  struct Case {
    CudaIpcAvailability a;
    std::string peer, message;
  };
  const std::vector<Case> cases = {
      {{false, true, true, true, 1, "gloo"}, "ipv4:127.0.0.1:1", "disabled on this server (--cuda-ipc-inputs=false)"},
      {{true, false, true, true, 1, "gloo"},
       "ipv4:127.0.0.1:1",
       "need CUDA workers; this server's workers run the CPU backend"},
      {{true, true, false, true, 1, "gloo"}, "ipv4:127.0.0.1:1", "need workers on the server's host"},
      {{true, true, true, false, 2, "gloo"},
       "ipv4:127.0.0.1:1",
       "need one worker or workers with device collectives (the workers read the client's GPU memory in one "
       "pass); this server has 2 workers over gloo"},
      {{true, true, true, true, 2, "nccl"}, "ipv4:10.0.0.7:1", "peer \"ipv4:10.0.0.7:1\" is not local"},
      {{true, true, true, true, 1, "gloo"}, "", "peer \"\" is not local"},
  };
  for (const Case& c : cases) {
    EXPECT_FALSE(c.a.available() && c.peer.rfind("ipv4:127", 0) == 0);
    const absl::Status st = CheckCudaIpcAvailable(c.a, c.peer);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << c.message;
    EXPECT_NE(st.message().find(c.message), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("send the hidden states as bytes (inline or through shared memory) instead"),
              std::string::npos)
        << st.message();
  }
}

TEST(ResolveCudaIpc, SamplingFiltersNeedBytes) {
  v1::ScoreRequest req = IpcRequest(1, 3, {1, 2, 3}, {});
  EXPECT_TRUE(ResolveStatus(req).ok());
  req.mutable_options()->set_sampling_top_p(1.0f);
  req.mutable_options()->set_topk(5);
  EXPECT_TRUE(ResolveStatus(req).ok());
  for (int which = 0; which < 2; ++which) {
    v1::ScoreRequest f = IpcRequest(1, 3, {1, 2, 3}, {});
    if (which == 0) f.mutable_options()->set_sampling_top_k(20);
    else f.mutable_options()->set_sampling_top_p(0.9f);
    const absl::Status st = ResolveStatus(f);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("options.sampling_top_k / options.sampling_top_p"), std::string::npos) << st;
    EXPECT_NE(st.message().find("send the tensor as bytes"), std::string::npos) << st;
    EXPECT_NE(st.message().find("CUDA IPC"), std::string::npos) << st;
  }
}

/// The job ScoringService::ScoreOne builds for an IPC request.
ScoreJob IpcJob(const v1::ScoreRequest& req, v1::ScoreOptions options = {}) {
  v1::ScoreRequest r = req;
  *r.mutable_options() = options;
  auto inputs = ResolveInputs(r, IpcContext());
  EXPECT_TRUE(inputs.ok()) << inputs.status();
  auto job = BuildScoreJob(r, RequestLimits{}, LmHeadShape{kV, kH}, &*inputs);
  EXPECT_TRUE(job.ok()) << job.status();
  return *std::move(job);
}

TEST(CudaIpcJob, EveryInputRowWithEachWorkersContiguousRange) {
  // B = 2, S = 4, seq_lens {3, 4}, next_token: scored input rows 0, 1 and
  // 4, 5, 6; rows 2, 3 (end and padding of sequence 0) and 7 (last of
  // sequence 1) are not scored.
  const v1::ScoreRequest req = IpcRequest(2, 4, {1, 2, 3, 0, 4, 5, 6, 7}, {3, 4});
  const ScoreJob job = IpcJob(req);
  ASSERT_NE(job.referenced_source(), nullptr);
  EXPECT_FALSE(job.batchable());
  EXPECT_EQ(job.num_rows(), 8);
  EXPECT_EQ(job.targets, (std::vector<int64_t>{2, 3, -1, -1, 5, 6, 7, -1}));
  EXPECT_EQ(job.out_pos, (std::vector<int64_t>{0, 1, -1, -1, 3, 4, 5, -1}));
  EXPECT_EQ(job.out_shape, (std::vector<int64_t>{2, 3}));

  constexpr int kWorkers = 3;
  PayloadPool pool;  // must not be used: nothing is copied
  const Plan plan = PlanWork(job, kWorkers, Parallelism::kAuto, 7, &pool);
  EXPECT_EQ(plan.layout, internal::v1::HIDDEN_STATES);
  EXPECT_EQ(plan.payload_region, nullptr);
  ASSERT_EQ(plan.items.size(), static_cast<size_t>(kWorkers));
  const int64_t row_bytes = kH * 4;
  for (int w = 0; w < kWorkers; ++w) {
    const auto& item = plan.items[w].item;
    const auto [b, e] = SplitRange(8, kWorkers, w);
    ASSERT_TRUE(item.has_cuda_ipc()) << w;
    EXPECT_EQ(item.cuda_ipc().handle(), std::string(64, 'h'));
    EXPECT_EQ(item.cuda_ipc().offset(), 256 + b * row_bytes) << w;
    EXPECT_EQ(item.cuda_ipc().byte_size(), (e - b) * row_bytes) << w;
    EXPECT_EQ(item.num_rows(), 8);
    EXPECT_EQ(std::vector<int64_t>(item.targets().begin(), item.targets().end()), job.targets);
  }
  // Nothing read the client's allocation here: the read check after the
  // batch (ScoringCore) passes; a Read (a planning bug) would fail it.
  EXPECT_TRUE(job.ReadStatus().ok()) << job.ReadStatus();
  std::vector<char> probe(16);
  EXPECT_FALSE(job.referenced_source()->Read(0, probe.size(), probe.data()));
  EXPECT_EQ(job.ReadStatus().code(), absl::StatusCode::kInternal);

  // Results: rank r returns its rows with token_logprob = -(row + 1).
  std::vector<internal::v1::WorkResult> results(kWorkers);
  for (int w = 0; w < kWorkers; ++w) {
    const auto [b, e] = SplitRange(8, kWorkers, w);
    results[w].set_row_begin(b);
    results[w].set_row_end(e);
    for (int64_t r = b; r < e; ++r) results[w].add_token_logprobs(-static_cast<float>(r + 1));
  }
  auto resp = BuildResponse(job, plan, results, 0);
  ASSERT_TRUE(resp.ok()) << resp.status();
  const std::vector<float> lp = Floats(*FindOutput(*resp, "token_logprobs"));
  // Output [2, 3]: sequence 0 positions 0, 1 (rows 0, 1), position 2 padding
  // (0); sequence 1 positions 0..2 (rows 4, 5, 6).
  EXPECT_EQ(lp, (std::vector<float>{-1, -2, 0, -5, -6, -7}));
}

TEST(CudaIpcJob, GatherIdsFollowTheirRows) {
  v1::ScoreRequest req = IpcRequest(1, 3, {1, 2, 3}, {});
  // next_token output [1, 2] with K = 2.
  *req.add_inputs() = IntTensor("gather_indices", {1, 2, 2}, {8, 9, 10, 11});
  const ScoreJob job = IpcJob(req);
  EXPECT_EQ(job.gather_k, 2);
  EXPECT_EQ(job.gather_ids, (std::vector<int64_t>{8, 9, 10, 11, 0, 0}));
}

TEST(CudaIpcJob, IsNeverBatchedWithAnother) {
  // Two CUDA IPC jobs of the same shape and options (one batch key but for
  // CUDA IPC) are both queued while a batch runs; every batch the runner
  // sees holds one job.
  const v1::ScoreRequest req = IpcRequest(1, 3, {1, 2, 3}, {});
  const auto a = std::make_shared<const ScoreJob>(IpcJob(req)), b = std::make_shared<const ScoreJob>(IpcJob(req));
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  int running = 0, queued = 0;
  std::vector<int64_t> batch_rows;
  Batcher::Options o;
  o.max_queue_delay = std::chrono::seconds(30);
  o.workers = 1;
  o.on_queue_change = [&](int64_t n) {
    std::lock_guard<std::mutex> l(mu);
    queued = static_cast<int>(n);
    cv.notify_all();
  };
  o.on_running_change = [&](int64_t n) {
    std::lock_guard<std::mutex> l(mu);
    running = static_cast<int>(n);
    cv.notify_all();
  };
  Batcher batcher(o, [&](const Plan& plan, const RunBounds&) -> absl::StatusOr<std::vector<internal::v1::WorkResult>> {
    std::unique_lock<std::mutex> l(mu);
    batch_rows.push_back(plan.items[0].item.num_rows());
    cv.wait(l, [&] { return release; });
    std::vector<internal::v1::WorkResult> out(plan.items.size());
    out[0].set_row_begin(0);
    out[0].set_row_end(plan.items[0].item.num_rows());
    for (int64_t r = 0; r < plan.items[0].item.num_rows(); ++r) out[0].add_token_logprobs(0);
    return out;
  });
  auto first = std::async(std::launch::async, [&] { return batcher.Run(a, 1, RunBounds{}); });
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(60), [&] { return running == 1; }));
  }
  auto second = std::async(std::launch::async, [&] { return batcher.Run(b, 2, RunBounds{}); });
  auto third = std::async(std::launch::async, [&] { return batcher.Run(a, 3, RunBounds{}); });
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(60), [&] { return queued == 2; }));
    release = true;
    cv.notify_all();
  }
  for (auto* f : {&first, &second, &third}) {
    auto r = f->get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->batch_requests, 1);
  }
  EXPECT_EQ(batch_rows, (std::vector<int64_t>{3, 3, 3}));
}

/// hidden_bf16 with its hidden states replaced by a CUDA IPC reference.
v1::ScoreRequest GoldenIpcRequest(int64_t byte_size_delta = 0) {
  v1::ScoreRequest req = GoldenRequest(LoadGolden("hidden_bf16"));
  for (v1::Tensor& t : *req.mutable_inputs())
    if (t.name() == "hidden_states") {
      const auto bytes = static_cast<int64_t>(t.data().size());
      t.mutable_cuda_ipc()->set_handle(std::string(64, '\x01'));  // replaces data (Tensor.source is a oneof)
      t.mutable_cuda_ipc()->set_byte_size(bytes + byte_size_delta);
    }
  return req;
}

grpc::Status Score(v1::LogprobService::Stub& stub, const v1::ScoreRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::ScoreResponse resp;
  return stub.Score(&ctx, req, &resp);
}

TEST(CudaIpcServer, CpuPoolReportsNoFeatureAndRefusesReferences) {
  auto server = ServerProcess::Start(2, {"--lm-head", GoldenDir() + "/hidden_bf16.lm_head.safetensors"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  v1::ServerInfo info;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  }
  EXPECT_FALSE(info.cuda_ipc_inputs());
  EXPECT_EQ(info.host_id().size(), 32u);

  grpc::Status st = Score(*stub, GoldenIpcRequest());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_NE(st.error_message().find("this server's workers run the CPU backend"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("send the hidden states as bytes"), std::string::npos) << st.error_message();

  // The same through ScoreChunked (the reference is no tensor to piece together).
  auto chunked = client::ScoreChunked(grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()),
                                      GoldenIpcRequest(), 1 << 20, 120);
  EXPECT_EQ(chunked.status().code(), absl::StatusCode::kFailedPrecondition) << chunked.status();
  EXPECT_NE(chunked.status().message().find("this server's workers run the CPU backend"), std::string::npos)
      << chunked.status();

  // Malformed references are INVALID_ARGUMENT whatever the pool.
  st = Score(*stub, GoldenIpcRequest(-2));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("\"hidden_states\": cuda_ipc.byte_size is"), std::string::npos)
      << st.error_message();
  v1::ScoreRequest short_handle = GoldenIpcRequest();
  for (v1::Tensor& t : *short_handle.mutable_inputs())
    if (t.has_cuda_ipc()) t.mutable_cuda_ipc()->set_handle("abc");
  st = Score(*stub, short_handle);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("cuda_ipc.handle is 3 bytes"), std::string::npos) << st.error_message();
  v1::ScoreRequest on_ids = GoldenRequest(LoadGolden("hidden_bf16"));
  for (v1::Tensor& t : *on_ids.mutable_inputs())
    if (t.name() == "input_ids") {
      const auto bytes = static_cast<int64_t>(t.data().size());
      t.mutable_cuda_ipc()->set_handle(std::string(64, '\x01'));
      t.mutable_cuda_ipc()->set_byte_size(bytes);
    }
  st = Score(*stub, on_ids);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("\"input_ids\": a CUDA IPC reference is only accepted for \"hidden_states\""),
            std::string::npos)
      << st.error_message();

  // The server goes on: bytes still score.
  v1::ScoreResponse resp;
  st = ScoreGolden(*stub, LoadGolden("hidden_bf16"), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

TEST(CudaIpcServer, FlagOffSaysSo) {
  auto server = ServerProcess::Start(1, {"--cuda-ipc-inputs=false"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const grpc::Status st = Score(*stub, GoldenIpcRequest());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("--cuda-ipc-inputs=false"), std::string::npos) << st.error_message();
}

}  // namespace
}  // namespace logprob::testing
