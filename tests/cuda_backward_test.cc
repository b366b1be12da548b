// The lm_head's backward on the GPU (worker/cuda/cuda_slice_backward.h)
// through the backward pass of W ranks sharing one GPU (each its own
// CudaBackend and slice): dL/dh, dL/dW and dL/db within 1e-4 of each row's
// largest float64 element plus 1e-7 of the float64 reference (f32 and
// bf16 weights; identity, bias + scale, bias + scale + softcap;
// temperature 1 and 0.7; fp32 and bf16 GEMM operands; one dL/dh tile or
// several); a row's dL/dh bitwise the same alone or in a batch, whatever
// the rounds; the token logprobs and entropies it answers bitwise those of
// the GPU's forward. Every test skips (GTEST_SKIP) on a machine without a
// usable CUDA device.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "common/status_macros.h"
#include "tests/backward_pass_harness.h"
#include "tests/head_backward_reference.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_slice_backward.h"
#include "worker/cuda/device_info.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scoring/cpu_slice_backward.h"

namespace logprob {
namespace {

using kernels::backward_reference::Case;
using kernels::backward_reference::Grads;
using kernels::backward_reference::H;
using kernels::backward_reference::kCases;
using kernels::backward_reference::Make;
using kernels::backward_reference::MatchesReference;
using kernels::backward_reference::N;
using kernels::backward_reference::Problem;
using kernels::backward_reference::V;

#define SKIP_WITHOUT_GPU()                                                           \
  do {                                                                               \
    if (auto n = cuda::DeviceCount(); !n.ok()) GTEST_SKIP() << n.status().message(); \
  } while (0)

/// A rank's GPU backward with what it uses: its backend and its slice.
class OwningSliceBackward final : public SliceBackward {
 public:
  OwningSliceBackward(std::unique_ptr<cuda::CudaBackend> backend, std::shared_ptr<const LmHeadWeights> head)
      : backend_(std::move(backend)), head_(std::move(head)) {}
  absl::Status Init(int64_t vb, float temperature, int64_t tile_columns) {
    LOGPROB_ASSIGN_OR_RETURN(
        inner_, cuda::CudaSliceBackward::Create(backend_.get(), static_cast<const cuda::CudaLmHead&>(*head_), vb,
                                                temperature, tile_columns));
    return absl::OkStatus();
  }
  int64_t rows() const override { return inner_->rows(); }
  int64_t hidden_size() const override { return inner_->hidden_size(); }
  int64_t vocab_begin() const override { return inner_->vocab_begin(); }
  float temperature() const override { return inner_->temperature(); }
  absl::Status Records(DType d, const void* h, int64_t m, const int64_t* t, const kernels::StatsSpec& spec,
                       uint32_t* records) override {
    return inner_->Records(d, h, m, t, spec, records);
  }
  absl::Status Gradients(const kernels::BackwardRows& rows, float* gh, float* gw, float* gb) override {
    return inner_->Gradients(rows, gh, gw, gb);
  }
  absl::Status Flush(float* gw, float* gb) override { return inner_->Flush(gw, gb); }

 private:
  std::unique_ptr<cuda::CudaBackend> backend_;
  std::shared_ptr<const LmHeadWeights> head_;
  std::unique_ptr<cuda::CudaSliceBackward> inner_;  // destroyed first
};

/// Rank slices on the GPU at `precision`, `tile_columns` per dL/dh tile (0: the default).
testing::MakeSliceBackward GpuSlice(LmHeadPrecision precision, int64_t tile_columns = 0) {
  return [=](const Case& c, const Problem& p, int64_t vb,
             int64_t ve) -> absl::StatusOr<std::unique_ptr<SliceBackward>> {
    LOGPROB_ASSIGN_OR_RETURN(auto backend, cuda::CudaBackend::Create(0));
    const size_t esize = DTypeSize(c.weight_dtype);
    LmHeadSlice slice;
    slice.dtype = c.weight_dtype;
    slice.weight = HostBytes(std::vector<char>(p.w_bytes.begin() + vb * H * esize, p.w_bytes.begin() + ve * H * esize));
    slice.rows = ve - vb;
    slice.hidden_size = H;
    slice.transform = c.transform;
    if (c.transform.has_bias) slice.bias.assign(p.bias.begin() + vb, p.bias.begin() + ve);
    LOGPROB_ASSIGN_OR_RETURN(auto head, backend->LoadLmHead(std::move(slice), precision));
    auto bw = std::make_unique<OwningSliceBackward>(std::move(backend), std::move(head));
    LOGPROB_RETURN_IF_ERROR(bw->Init(vb, c.temperature, tile_columns));
    return std::unique_ptr<SliceBackward>(std::move(bw));
  };
}

class CudaBackward : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(CudaBackward, Fp32GradientsMatchFloat64) {
  SKIP_WITHOUT_GPU();
  const auto [case_index, workers] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 500 + case_index);
  const Grads g = testing::BackwardPass(c, p, workers, 0, N, 32, GpuSlice(LmHeadPrecision::kFp32));
  EXPECT_EQ(MatchesReference(g, p), "");
}

TEST_P(CudaBackward, SeveralDhTilesMatchFloat64) {
  // 64 columns per tile: V = 300 over W ranks is several tiles, the last
  // one partial (its own matmul shape).
  SKIP_WITHOUT_GPU();
  const auto [case_index, workers] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 600 + case_index);
  const Grads g = testing::BackwardPass(c, p, workers, 0, N, 32, GpuSlice(LmHeadPrecision::kFp32, 64));
  EXPECT_EQ(MatchesReference(g, p), "");
}

TEST_P(CudaBackward, ARowsGradientIsTheSameAloneOrInABatch) {
  SKIP_WITHOUT_GPU();
  const auto [case_index, workers] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 700 + case_index);
  const auto make = GpuSlice(LmHeadPrecision::kFp32, 64);
  const Grads all = testing::BackwardPass(c, p, workers, 0, N, 32, make);
  const Grads alone = testing::BackwardPass(c, p, workers, 66, 1, 32, make);
  const Grads other_rounds = testing::BackwardPass(c, p, workers, 5, N - 5, 7, make);
  EXPECT_EQ(std::memcmp(alone.dh.data(), all.dh.data() + 66 * H, H * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(other_rounds.dh.data() + 61 * H, all.dh.data() + 66 * H, H * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackward, ::testing::Combine(::testing::Range(0, 4), ::testing::Values(1, 3)));

TEST(CudaBackwardBf16, Bf16OperandsAndWidenedWeightTilesMatchFloat64) {
  // bf16 weights and bf16-valued hidden states: the bf16 GEMM's operands
  // are exact, and dL/dh multiplies the weights widened a tile at a time.
  SKIP_WITHOUT_GPU();
  for (int case_index : {1, 3}) {
    Case c = kCases[case_index];
    c.bf16_hidden = true;
    const Problem p = Make(c, 800 + case_index);
    for (int workers : {1, 3}) {
      const Grads g = testing::BackwardPass(c, p, workers, 0, N, 32, GpuSlice(LmHeadPrecision::kBf16, 64));
      EXPECT_EQ(MatchesReference(g, p), "") << "case " << case_index << ", " << workers << " workers";
    }
  }
}

TEST(CudaBackwardTf32, TheGpusTf32OperandsAreTheCpus) {
  // At tf32 both backends round the weights and the hidden rows to tf32
  // (the forward's operands) before the backward's f32 GEMMs: the GPU's
  // gradients are the CPU's within the tests' tolerance (not float64's:
  // tf32 logits are 1e-3 off).
  SKIP_WITHOUT_GPU();
  for (int case_index : {0, 2}) {
    const Case& c = kCases[case_index];
    const Problem p = Make(c, 1000 + case_index);
    const testing::MakeSliceBackward cpu = [](const Case& c, const Problem& p, int64_t vb,
                                              int64_t ve) -> absl::StatusOr<std::unique_ptr<SliceBackward>> {
      const size_t esize = DTypeSize(c.weight_dtype);
      std::vector<char> w(p.w_bytes.begin() + vb * H * esize, p.w_bytes.begin() + ve * H * esize);
      LOGPROB_ASSIGN_OR_RETURN(auto gemm, kernels::LmHeadGemm::Create(c.weight_dtype, HostBytes(std::move(w)), ve - vb,
                                                                      H, 1, LmHeadPrecision::kTf32));
      LOGPROB_ASSIGN_OR_RETURN(auto backward, kernels::HeadSliceBackward::Create(gemm.get(), vb, p.bias.data() + vb,
                                                                                 c.transform, c.temperature));
      return std::unique_ptr<SliceBackward>(std::make_unique<CpuSliceBackward>(std::move(backward), std::move(gemm)));
    };
    const Grads want = testing::BackwardPass(c, p, 1, 0, N, 32, cpu);
    const Grads got = testing::BackwardPass(c, p, 1, 0, N, 32, GpuSlice(LmHeadPrecision::kTf32, 64));
    using kernels::backward_reference::WithinRowTolerance;
    const std::vector<double> dh(want.dh.begin(), want.dh.end()), dw(want.dw.begin(), want.dw.end()),
        db(want.db.begin(), want.db.end());
    EXPECT_EQ(WithinRowTolerance(got.dh, dh, N, H, "dL/dh"), "") << "case " << case_index;
    EXPECT_EQ(WithinRowTolerance(got.dw, dw, V, H, "dL/dW"), "") << "case " << case_index;
    EXPECT_EQ(WithinRowTolerance(got.db, db, 1, V, "dL/db"), "") << "case " << case_index;
  }
}

TEST(CudaBackwardForward, ItsLogprobsAndEntropiesAreTheForwardsBits) {
  // The backward recomputes the logits with the forward's GEMM algorithm
  // and records them with the forward's row kernel.
  SKIP_WITHOUT_GPU();
  const Case& c = kCases[2];
  const Problem p = Make(c, 950);
  auto bw = GpuSlice(LmHeadPrecision::kFp32)(c, p, 0, V);
  ASSERT_TRUE(bw.ok()) << bw.status();
  testing::InProcessGroup group(1);
  testing::InProcessCommunicator comm(group, 0);
  BackwardPassRows in;
  in.hidden = p.h.data();
  in.rows = N;
  in.targets = p.targets.data();
  in.grad_logprobs = p.g_lp.data();
  in.round_rows = 32;
  std::vector<float> dh(N * H), lp(N), ent(N);
  ASSERT_TRUE(RunBackwardPass(in, **bw, V, comm, dh.data(), nullptr, nullptr, lp.data(), ent.data()).ok());

  auto backend = cuda::CudaBackend::Create(0);
  ASSERT_TRUE(backend.ok());
  LmHeadSlice slice;
  slice.dtype = c.weight_dtype;
  slice.weight = HostBytes(std::vector<char>(p.w_bytes.begin(), p.w_bytes.end()));
  slice.rows = V;
  slice.hidden_size = H;
  slice.transform = c.transform;
  slice.bias = p.bias;
  auto head = (*backend)->LoadLmHead(std::move(slice), LmHeadPrecision::kFp32);
  ASSERT_TRUE(head.ok()) << head.status();
  kernels::StatsSpec spec;
  spec.temperature = c.temperature;
  spec.entropy = true;
  spec.vocab_size = V;
  const size_t words = kernels::PartialWords(spec);
  std::vector<uint32_t> records(N * words);
  BlockRows rows;
  rows.count = N;
  rows.targets = p.targets.data();
  ASSERT_TRUE((*backend)->HiddenPartials(**head, v1::F32, p.h.data(), 0, rows, spec, records.data()).ok());
  for (int64_t i = 0; i < N; ++i) {
    float want_lp = 0.0f, want_ent = 0.0f;
    kernels::RowOutput out;
    out.token_logprob = &want_lp;
    out.entropy = &want_ent;
    const uint32_t* rec = records.data() + i * words;
    kernels::CombinePartials(&rec, 1, spec, p.targets[i] >= 0, out);
    if (p.targets[i] >= 0) {
      EXPECT_EQ(std::memcmp(&lp[i], &want_lp, 4), 0) << "row " << i;
    }
    EXPECT_EQ(std::memcmp(&ent[i], &want_ent, 4), 0) << "row " << i;
  }
}

TEST(CudaBackwardErrors, GradientsWithoutRecordsAndBadTilesAreRefused) {
  SKIP_WITHOUT_GPU();
  const Case& c = kCases[0];
  const Problem p = Make(c, 900);
  auto bw = GpuSlice(LmHeadPrecision::kFp32)(c, p, 0, V);
  ASSERT_TRUE(bw.ok()) << bw.status();
  std::vector<float> dh(H);
  kernels::BackwardRows rows;
  EXPECT_EQ((*bw)->Gradients(rows, dh.data(), nullptr, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  auto backend = cuda::CudaBackend::Create(0);
  ASSERT_TRUE(backend.ok());
  LmHeadSlice slice;
  slice.dtype = v1::F32;
  slice.weight = HostBytes(std::vector<char>(p.w_bytes.begin(), p.w_bytes.end()));
  slice.rows = V;
  slice.hidden_size = H;
  auto head = (*backend)->LoadLmHead(std::move(slice), LmHeadPrecision::kFp32);
  ASSERT_TRUE(head.ok());
  const auto& cuda_head = static_cast<const cuda::CudaLmHead&>(**head);
  EXPECT_EQ(cuda::CudaSliceBackward::Create(backend->get(), cuda_head, 0, 1.0f, 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::CudaSliceBackward::Create(backend->get(), cuda_head, 0, 0.0f).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace logprob
