// WorkerService::Run after a device fault (issue 35 item 2): once the
// backend's device is lost (ScoringBackend::device_lost, a sticky CUDA
// error in the CUDA backend) every item is answered UNAVAILABLE, the code
// on which the front-end re-forms the pool, whatever the item's own
// error. A fake backend stands in for the GPU: CPU only.
#include "worker/worker_service.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "worker/communicator.h"
#include "worker/lm_head_registry.h"

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

}  // namespace
}  // namespace logprob
