// The backward pass of a group of workers (worker/scoring/backward_pass.h),
// W ranks as threads over the in-process communicator, each with its slice
// of a random head: the ranks' dL/dh shares summed in rank order, and their
// dL/dW / dL/db, within 1e-4 of each row's largest float64 element plus
// 1e-7 of the float64 reference computed from the forward's own statistics
// (which the pass recomputes: the client sends none); a row's dL/dh bitwise
// the same alone or in a batch, whatever the rounds.
#include "worker/scoring/backward_pass.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/status_macros.h"
#include "tests/backward_pass_harness.h"
#include "tests/head_backward_reference.h"
#include "tests/in_process_communicator.h"
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
using kernels::backward_reference::WithinRowTolerance;

/// Rank slices on the CPU: the slice's oneDNN GEMM (fp32) and its backward.
absl::StatusOr<std::unique_ptr<SliceBackward>> CpuSlice(const Case& c, const Problem& p, int64_t vb, int64_t ve) {
  const size_t esize = DTypeSize(c.weight_dtype);
  std::vector<char> w(p.w_bytes.begin() + vb * H * esize, p.w_bytes.begin() + ve * H * esize);
  LOGPROB_ASSIGN_OR_RETURN(auto gemm, kernels::LmHeadGemm::Create(c.weight_dtype, HostBytes(std::move(w)), ve - vb, H,
                                                                  1, LmHeadPrecision::kFp32));
  LOGPROB_ASSIGN_OR_RETURN(auto backward, kernels::HeadSliceBackward::Create(gemm.get(), vb, p.bias.data() + vb,
                                                                             c.transform, c.temperature));
  return std::make_unique<CpuSliceBackward>(std::move(backward), std::move(gemm));
}

/// Rows [row_begin, row_begin + rows) of `p` through W ranks.
Grads Pass(const Case& c, const Problem& p, int W, int64_t row_begin, int64_t rows, int64_t round_rows) {
  return testing::BackwardPass(c, p, W, row_begin, rows, round_rows, CpuSlice);
}

class BackwardPass : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(BackwardPass, GradientsMatchFloat64WithoutClientStatistics) {
  const auto [case_index, workers] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 300 + case_index);
  const Grads g = Pass(c, p, workers, 0, N, 32);  // three rounds, the last partial
  EXPECT_EQ(MatchesReference(g, p), "");
}

TEST_P(BackwardPass, ARowsGradientIsTheSameAloneOrInABatch) {
  const auto [case_index, workers] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 400 + case_index);
  const Grads all = Pass(c, p, workers, 0, N, 32);
  const Grads alone = Pass(c, p, workers, 66, 1, 32);
  const Grads other_rounds = Pass(c, p, workers, 5, N - 5, 7);
  EXPECT_EQ(std::memcmp(alone.dh.data(), all.dh.data() + 66 * H, H * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(other_rounds.dh.data() + 61 * H, all.dh.data() + 66 * H, H * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, BackwardPass, ::testing::Combine(::testing::Range(0, 4), ::testing::Values(1, 3)));

TEST(BackwardPassErrors, BadRowsAreRefused) {
  std::vector<float> w(V * H, 0.1f);
  std::vector<char> bytes(reinterpret_cast<char*>(w.data()), reinterpret_cast<char*>(w.data()) + w.size() * 4);
  auto gemm = kernels::LmHeadGemm::Create(v1::F32, HostBytes(std::move(bytes)), V, H);
  ASSERT_TRUE(gemm.ok());
  auto kernel = kernels::HeadSliceBackward::Create(gemm->get(), 0, nullptr, LmHeadTransform{}, 1.0f);
  ASSERT_TRUE(kernel.ok());
  CpuSliceBackward bw(std::move(*kernel));
  testing::InProcessGroup group(1);
  testing::InProcessCommunicator comm(group, 0);
  std::vector<float> dh(H);
  BackwardPassRows in;
  in.rows = 1;  // no hidden states
  EXPECT_EQ(RunBackwardPass(in, bw, V, comm, dh.data(), nullptr, nullptr).code(), absl::StatusCode::kInvalidArgument);
  in.round_rows = 0;
  EXPECT_EQ(RunBackwardPass(in, bw, V, comm, dh.data(), nullptr, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace logprob
