// WorkerService::Run after a device fault (issue 35 item 2): once the
// backend's device is lost (ScoringBackend::device_lost, a sticky CUDA
// error in the CUDA backend) every item is answered UNAVAILABLE, the code
// on which the front-end re-forms the pool, whatever the item's own
// error. A fake backend stands in for the GPU: CPU only. A failed call
// carries the worker's error reason (issue 31 item 7) as the trailing
// metadata the front-end reads (SentReason). Ranks handed items of
// different runs (one the plan did not send to all of them) refuse them on
// every rank and stay in step.
#include "worker/worker_service.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/grpc_status.h"
#include "common/worker_protocol.h"
#include "tests/in_process_communicator.h"
#include "worker/comm/communicator.h"
#include "worker/heads/lm_head_registry.h"
#include "worker/scoring/cpu_backend.h"

namespace logprob {
namespace {

/// A backend whose kernels fail as a faulted device's do (INTERNAL, as
/// cuBLASLt reports an execution failure) and whose device_lost() the test
/// sets.
class FaultedBackend final : public ScoringBackend {
 public:
  explicit FaultedBackend(const std::atomic<bool>* lost) : lost_(lost) {}
  std::string name() const override { return "faulted"; }
  absl::Status SlicePartials(const LogitsBlock&, const BlockRows&, const kernels::StatsSpec&, uint32_t*) override {
    return absl::InternalError("cuBLASLt matmul: CUBLAS_STATUS_EXECUTION_FAILED");
  }
  absl::Status FilteredRowPartials(const LogitsBlock&, const BlockRows&, const kernels::StatsSpec&,
                                   const SamplingFilter&, uint32_t*) override {
    return absl::InternalError("cuBLASLt matmul: CUBLAS_STATUS_EXECUTION_FAILED");
  }
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice, LmHeadPrecision) override {
    return absl::InternalError("not in this test");
  }
  absl::Status HiddenPartials(const LmHeadWeights&, DType, const void*, int64_t, const BlockRows&,
                              const kernels::StatsSpec&, uint32_t*) override {
    return absl::InternalError("not in this test");
  }
  absl::Status HiddenLogits(const LmHeadWeights&, DType, const void*, int64_t, float*) override {
    return absl::InternalError("not in this test");
  }
  bool device_lost() const override { return lost_->load(); }

 private:
  const std::atomic<bool>* lost_;
};

/// One token-parallel logits item of 2 rows x 4 f32 logits.
internal::v1::WorkItem LogitsItem() {
  internal::v1::WorkItem item;
  item.set_layout(internal::v1::TOKEN_PARALLEL);
  item.set_dtype(v1::F32);
  item.set_num_rows(2);
  item.set_vocab_size(4);
  item.set_vocab_begin(0);
  item.set_vocab_end(4);
  item.add_targets(1);
  item.add_targets(2);
  item.set_data(std::string(2 * 4 * 4, '\0'));
  return item;
}

TEST(WorkerServiceDeviceLost, EveryItemIsUnavailableOnceTheDeviceIsLost) {
  std::atomic<bool> lost{false};
  auto backend = std::make_unique<FaultedBackend>(&lost);
  auto lm_heads = std::make_unique<LmHeadRegistry>(*backend, LmHeadPrecision::kAuto, 0, 1);
  WorkerService service(std::make_unique<SelfCommunicator>(), std::move(backend), std::move(lm_heads));
  const internal::v1::WorkItem item = LogitsItem();
  internal::v1::WorkResult result;
  {
    grpc::ServerContext ctx;
    const grpc::Status st = service.Run(&ctx, &item, &result);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INTERNAL) << st.error_message();  // the item's own error
    EXPECT_NE(st.error_message().find("CUBLAS_STATUS_EXECUTION_FAILED"), std::string::npos) << st.error_message();
  }
  lost.store(true);
  {
    grpc::ServerContext ctx;
    const grpc::Status st = service.Run(&ctx, &item, &result);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
    EXPECT_EQ(st.error_message(),
              "the worker's CUDA device faulted; it leaves the pool: cuBLASLt matmul: CUBLAS_STATUS_EXECUTION_FAILED");
  }
}

/// A Worker service on an in-process gRPC server: the calls cross gRPC
/// (status and trailing metadata) as the front-end's do.
class WorkerOverGrpc {
 public:
  /// `admission`: what the front-end's JoinReply would say (the store
  /// folder StageLmHeadRows writes in, ...).
  explicit WorkerOverGrpc(std::unique_ptr<ScoringBackend> backend, WorkerAdmission admission = WorkerAdmission()) {
    auto lm_heads = std::make_unique<LmHeadRegistry>(*backend, LmHeadPrecision::kAuto, 0, 1);
    service_ = std::make_unique<WorkerService>(std::make_unique<SelfCommunicator>(), std::move(backend),
                                               std::move(lm_heads), kDefaultHiddenChunkTokens, std::move(admission));
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    stub_ = internal::v1::Worker::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  ~WorkerOverGrpc() { server_->Shutdown(); }
  internal::v1::Worker::Stub& stub() { return *stub_; }

 private:
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<internal::v1::Worker::Stub> stub_;
};

TEST(WorkerServiceReasons, AFailedCallCarriesTheWorkersReason) {
  std::atomic<bool> lost{false};
  WorkerAdmission admission;
  admission.lm_head_store_dir = "/nonexistent-store";
  WorkerOverGrpc worker(std::make_unique<FaultedBackend>(&lost), admission);  // no GPU: no CUDA IPC
  internal::v1::WorkResult result;

  // A CUDA IPC payload this worker cannot open: the client sends bytes.
  internal::v1::WorkItem ipc = LogitsItem();
  ipc.mutable_cuda_ipc()->set_handle(std::string(64, 'h'));
  ipc.mutable_cuda_ipc()->set_byte_size(2 * 4 * 4);
  {
    grpc::ClientContext ctx;
    const grpc::Status st = worker.stub().Run(&ctx, ipc, &result);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_EQ(SentReason(ctx), v1::CUDA_IPC_UNAVAILABLE) << st.error_message();
  }
  // A hidden-states item naming a head this worker lacks: not a CUDA IPC
  // refusal, whatever the payload.
  internal::v1::WorkItem hidden = LogitsItem();
  hidden.set_layout(internal::v1::HIDDEN_STATES);
  hidden.mutable_lm_head()->set_name("default");
  hidden.mutable_lm_head()->set_version("v9");
  {
    grpc::ClientContext ctx;
    const grpc::Status st = worker.stub().Run(&ctx, hidden, &result);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_NE(st.error_message().find("holds no lm_head 'default' version 'v9'"), std::string::npos)
        << st.error_message();
    EXPECT_EQ(SentReason(ctx), v1::LM_HEAD_VERSION_UNAVAILABLE) << st.error_message();
  }
  // An item's own error has no reason.
  {
    grpc::ClientContext ctx;
    const grpc::Status st = worker.stub().Run(&ctx, LogitsItem(), &result);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INTERNAL) << st.error_message();
    EXPECT_EQ(SentReason(ctx), v1::ERROR_REASON_UNSPECIFIED) << st.error_message();
  }
  // Update rows by CUDA IPC on a worker without device memory.
  internal::v1::LmHeadStage stage;
  stage.mutable_source()->set_handle(std::string(64, 'h'));
  stage.mutable_source()->set_byte_size(16);
  // StageLmHeadRows of `stage` into `file`: its status and the reason sent.
  auto staged = [&](const std::string& file) {
    stage.set_file(file);
    grpc::ClientContext ctx;
    internal::v1::LmHeadStageReply reply;
    const grpc::Status st = worker.stub().StageLmHeadRows(&ctx, stage, &reply);
    return std::make_pair(st, SentReason(ctx));
  };
  {
    const auto [st, reason] = staged("/nonexistent-store/default-1.safetensors.partial");
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_EQ(reason, v1::CUDA_IPC_UNAVAILABLE) << st.error_message();
  }
  // A file outside the store the front-end named: refused before the
  // backend is asked, with no CUDA IPC reason (the client must not fall
  // back to bytes for it).
  {
    const auto [st, reason] = staged("/tmp/default-1.safetensors.partial");
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_EQ(reason, v1::ERROR_REASON_UNSPECIFIED) << st.error_message();
  }
}

/// One rank's vocab-parallel item: 2 rows of zero f32 logits over V = 4,
/// this rank's half of the columns; targets 1 and 2.
internal::v1::WorkItem HalfVocabItem(int rank) {
  internal::v1::WorkItem item = LogitsItem();
  item.set_layout(internal::v1::VOCAB_PARALLEL);
  item.set_vocab_begin(2 * rank);
  item.set_vocab_end(2 * rank + 2);
  item.set_data(std::string(2 * 2 * 4, '\0'));
  return item;
}

TEST(WorkerServicePasses, RanksOnItemsOfDifferentRunsRefuseThemAndStayInStep) {
  testing::InProcessGroup group(2, std::chrono::seconds(60));
  std::vector<std::unique_ptr<WorkerService>> services;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  std::vector<std::unique_ptr<internal::v1::Worker::Stub>> stubs;
  for (int r = 0; r < 2; ++r) {
    auto backend = std::make_unique<CpuBackend>(/*threads=*/1);
    auto lm_heads = std::make_unique<LmHeadRegistry>(*backend, LmHeadPrecision::kAuto, r, 2);
    services.push_back(std::make_unique<WorkerService>(std::make_unique<testing::InProcessCommunicator>(group, r),
                                                       std::move(backend), std::move(lm_heads)));
    grpc::ServerBuilder builder;
    builder.RegisterService(services.back().get());
    servers.push_back(builder.BuildAndStart());
    stubs.push_back(internal::v1::Worker::NewStub(servers.back()->InProcessChannel(grpc::ChannelArguments())));
  }
  // Both ranks' items at once, rank r's call carrying run runs[r].
  const auto run_both = [&](const std::array<uint64_t, 2>& runs, std::array<grpc::Status, 2>* st,
                            std::array<internal::v1::WorkResult, 2>* res) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        grpc::ClientContext ctx;
        ctx.AddMetadata(kRunIdMetadataKey, std::to_string(runs[r]));
        (*st)[r] = stubs[r]->Run(&ctx, HalfVocabItem(r), &(*res)[r]);
      });
    for (auto& t : threads) t.join();
  };
  std::array<grpc::Status, 2> st;
  std::array<internal::v1::WorkResult, 2> res;
  // An item one rank got and the other did not (runs 7 and 8): refused on
  // both, neither rank waits in the other's collectives nor fails.
  run_both({7, 8}, &st, &res);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].error_code(), grpc::StatusCode::FAILED_PRECONDITION) << r << ": " << st[r].error_message();
    EXPECT_NE(st[r].error_message().find("the ranks are not on the same item"), std::string::npos)
        << st[r].error_message();
  }
  // The ranks are still in step: the next item of one run scores (each
  // rank answers its share of the rows), log(1/4) for every target.
  run_both({9, 9}, &st, &res);
  int rows = 0;
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].ok()) << r << ": " << st[r].error_message();
    ASSERT_EQ(res[r].token_logprobs_size(), res[r].row_end() - res[r].row_begin());
    rows += res[r].token_logprobs_size();
    for (const float lp : res[r].token_logprobs()) EXPECT_NEAR(lp, -std::log(4.0), 1e-6);
  }
  EXPECT_EQ(rows, 2);
  for (auto& server : servers) server->Shutdown();
}

}  // namespace
}  // namespace logprob
