// The lm_head's backward over vocabulary slices (worker/kernels/head_backward.h)
// against float64: dL/dh, dL/dW and dL/db of random heads (f32 and bf16
// weights; identity, bias + scale, softcap transforms; temperature 1 and
// 0.7; ignored rows; logprob and entropy gradients) on 1 and 3 slices,
// every element within 1e-4 of its row's largest float64 element plus
// 1e-7; a row's dL/dh bitwise the same alone or in a batch; dL/dW
// accumulated over two micro-batches equal to one batch's.
#include "worker/kernels/head_backward.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tests/head_backward_reference.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::kernels {
namespace {

using backward_reference::Case;
using backward_reference::Grads;
using backward_reference::H;
using backward_reference::kCases;
using backward_reference::Make;
using backward_reference::MatchesReference;
using backward_reference::N;
using backward_reference::Problem;
using backward_reference::V;
using backward_reference::WithinRowTolerance;

/// The kernel's gradients over `slices` equal slices of the vocabulary:
/// dL/dh summed over the slices in order, dL/dW and dL/db concatenated.
Grads Backward(const Case& c, const Problem& p, int slices, int64_t row_begin, int64_t rows, bool weights = true) {
  Grads out;
  out.dh.assign(rows * H, 0.0f);
  out.dw.assign(V * H, 0.0f);
  out.db.assign(V, 0.0f);
  const size_t esize = DTypeSize(c.weight_dtype);
  BackwardRows r;
  r.targets = p.targets.data() + row_begin;
  r.lse = p.lse.data() + row_begin;
  r.entropy = p.entropy.data() + row_begin;
  r.grad_logprobs = p.g_lp.data() + row_begin;
  r.grad_entropy = p.g_ent.data() + row_begin;
  for (int s = 0; s < slices; ++s) {
    const int64_t vb = V * s / slices, ve = V * (s + 1) / slices;
    std::vector<char> w(p.w_bytes.begin() + vb * H * esize, p.w_bytes.begin() + ve * H * esize);
    auto gemm = LmHeadGemm::Create(c.weight_dtype, HostBytes(std::move(w)), ve - vb, H, 0, LmHeadPrecision::kFp32);
    EXPECT_TRUE(gemm.ok()) << gemm.status();
    if (!gemm.ok()) return out;
    auto bw = HeadSliceBackward::Create(gemm->get(), vb, p.bias.data() + vb, c.transform, c.temperature);
    EXPECT_TRUE(bw.ok()) << bw.status();
    if (!bw.ok()) return out;
    std::vector<float> dh(rows * H);
    const absl::Status st =
        (*bw)->Run(v1::F32, p.h.data() + row_begin * H, rows, r, dh.data(), weights ? out.dw.data() + vb * H : nullptr,
                   weights ? out.db.data() + vb : nullptr);
    EXPECT_TRUE(st.ok()) << st;
    for (int64_t k = 0; k < rows * H; ++k) out.dh[k] += dh[k];
  }
  return out;
}

class HeadBackward : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(HeadBackward, GradientsMatchFloat64) {
  const auto [case_index, slices] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 100 + case_index);
  const Grads g = Backward(c, p, slices, 0, N);
  EXPECT_EQ(MatchesReference(g, p), "");
}

TEST_P(HeadBackward, RowsAreBatchInvariantAndWeightGradientsAccumulate) {
  const auto [case_index, slices] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 200 + case_index);
  const Grads all = Backward(c, p, slices, 0, N);
  // Row 66 alone, and rows 3..69 (row 66 at another position).
  const Grads alone = Backward(c, p, slices, 66, 1, false);
  const Grads shifted = Backward(c, p, slices, 3, N - 3, false);
  EXPECT_EQ(std::memcmp(alone.dh.data(), all.dh.data() + 66 * H, H * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(shifted.dh.data() + 63 * H, all.dh.data() + 66 * H, H * sizeof(float)), 0);
  // dL/dW and dL/db over two micro-batches, accumulated: one batch's.
  Grads first = Backward(c, p, slices, 0, 35), second = Backward(c, p, slices, 35, N - 35);
  for (int64_t k = 0; k < V * H; ++k) first.dw[k] += second.dw[k];
  for (int64_t k = 0; k < V; ++k) first.db[k] += second.db[k];
  std::vector<double> dw(all.dw.begin(), all.dw.end()), db(all.db.begin(), all.db.end());
  EXPECT_EQ(WithinRowTolerance(first.dw, dw, V, H, "accumulated dL/dW"), "");
  EXPECT_EQ(WithinRowTolerance(first.db, db, 1, V, "accumulated dL/db"), "");
}

INSTANTIATE_TEST_SUITE_P(Cases, HeadBackward, ::testing::Combine(::testing::Range(0, 4), ::testing::Values(1, 3)));

TEST(HeadBackwardErrors, BadArgumentsAreRefused) {
  std::vector<float> w(V * H, 0.1f);
  std::vector<char> bytes(reinterpret_cast<char*>(w.data()), reinterpret_cast<char*>(w.data()) + w.size() * 4);
  auto gemm = LmHeadGemm::Create(v1::F32, HostBytes(std::move(bytes)), V, H);
  ASSERT_TRUE(gemm.ok());
  EXPECT_EQ(HeadSliceBackward::Create(gemm->get(), 0, nullptr, LmHeadTransform{}, 0.0f).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HeadSliceBackward::Create(gemm->get(), 0, nullptr, LmHeadTransform{true, 1.0, 0.0}, 1.0f).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto bw = HeadSliceBackward::Create(gemm->get(), 0, nullptr, LmHeadTransform{}, 1.0f);
  ASSERT_TRUE(bw.ok());
  std::vector<float> h(H, 1.0f), dh(H), lse(1, 0.0f), g(1, 1.0f);
  BackwardRows r;
  r.lse = lse.data();
  r.grad_entropy = g.data();  // without the forward's entropy
  EXPECT_EQ((*bw)->Run(v1::F32, h.data(), 1, r, dh.data(), nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  r.grad_entropy = nullptr;
  r.lse = nullptr;
  EXPECT_EQ((*bw)->Run(v1::F32, h.data(), 1, r, dh.data(), nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace logprob::kernels
