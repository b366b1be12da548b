// The lm_head's backward over vocabulary slices (worker/kernels/head_backward.h)
// against float64: dL/dh, dL/dW and dL/db of random heads (f32 and bf16
// weights; identity, bias + scale, softcap transforms; temperature 1 and
// 0.7; ignored rows; logprob and entropy gradients) on 1 and 3 slices,
// every element within 1e-4 of its row's largest float64 element plus
// 1e-7; a row's dL/dh bitwise the same alone or in a batch (also over
// several of the kernel's row chunks); dL/dW accumulated over two
// micro-batches equal to one batch's.
#include "worker/kernels/head_backward.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tests/head_backward_reference.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/kernels/lm_head_transform_simd.h"

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

/// More rows than one of the kernel's chunks (600: chunks of 256, 256 and
/// 88 rows, tiles of 64): a problem's N rows repeated, so each row's
/// copies sit at other positions, in other chunks and row tiles. Every
/// copy's dL/dh bitwise the same (and within the float64 reference's
/// tolerance), alone or shifted; RunOnLogits bitwise Run; dL/dW and dL/db
/// over two calls split inside a chunk equal to one call's.
TEST(HeadBackwardChunks, ManyRowsAreBatchInvariant) {
  constexpr int64_t kM = 600;
  for (const int case_index : {1, 3}) {
    SCOPED_TRACE(case_index);
    const Case& c = kCases[case_index];
    const Problem p = Make(c, 300 + case_index);
    std::vector<float> h(kM * H), lse(kM), entropy(kM), g_lp(kM), g_ent(kM);
    std::vector<int64_t> targets(kM);
    for (int64_t i = 0; i < kM; ++i) {
      const int64_t s = i % N;
      std::memcpy(h.data() + i * H, p.h.data() + s * H, H * sizeof(float));
      lse[i] = p.lse[s];
      entropy[i] = p.entropy[s];
      g_lp[i] = p.g_lp[s];
      g_ent[i] = p.g_ent[s];
      targets[i] = p.targets[s];
    }
    auto gemm =
        LmHeadGemm::Create(c.weight_dtype, HostBytes(std::vector<char>(p.w_bytes)), V, H, 0, LmHeadPrecision::kFp32);
    ASSERT_TRUE(gemm.ok()) << gemm.status();
    auto bw = HeadSliceBackward::Create(gemm->get(), 0, p.bias.data(), c.transform, c.temperature);
    ASSERT_TRUE(bw.ok()) << bw.status();
    // Rows [begin, begin + n) by Run, or by RunOnLogits on the logits as
    // the forward computes them; dL/dW and dL/db added to g's.
    auto backward = [&](int64_t begin, int64_t n, bool on_logits, Grads& g) {
      g.dh.assign(n * H, 0.0f);
      g.dw.resize(V * H, 0.0f);
      g.db.resize(V, 0.0f);
      BackwardRows r;
      r.targets = targets.data() + begin;
      r.lse = lse.data() + begin;
      r.entropy = entropy.data() + begin;
      r.grad_logprobs = g_lp.data() + begin;
      r.grad_entropy = g_ent.data() + begin;
      absl::Status st;
      if (on_logits) {
        std::vector<float> logits(n * V);
        st = (*gemm)->Compute(v1::F32, h.data() + begin * H, n, logits.data());
        ASSERT_TRUE(st.ok()) << st;
        ApplyLmHeadTransformSimd(c.transform, (*bw)->bias(), n, V, logits.data());
        st = (*bw)->RunOnLogits(v1::F32, h.data() + begin * H, n, r, logits.data(), g.dh.data(), g.dw.data(),
                                g.db.data());
      } else {
        st = (*bw)->Run(v1::F32, h.data() + begin * H, n, r, g.dh.data(), g.dw.data(), g.db.data());
      }
      ASSERT_TRUE(st.ok()) << st;
    };
    Grads all, on_logits, alone, shifted, halves;
    backward(0, kM, false, all);
    for (int64_t i = N; i < kM; ++i)
      ASSERT_EQ(std::memcmp(all.dh.data() + i * H, all.dh.data() + (i % N) * H, H * sizeof(float)), 0) << "row " << i;
    EXPECT_EQ(WithinRowTolerance(std::vector<float>(all.dh.begin(), all.dh.begin() + N * H), p.dh, N, H, "dL/dh"), "");
    backward(0, kM, true, on_logits);
    EXPECT_EQ(on_logits.dh, all.dh);
    EXPECT_EQ(on_logits.dw, all.dw);
    EXPECT_EQ(on_logits.db, all.db);
    backward(333, 1, false, alone);
    EXPECT_EQ(std::memcmp(alone.dh.data(), all.dh.data() + 333 * H, H * sizeof(float)), 0);
    backward(29, kM - 29, false, shifted);
    EXPECT_EQ(std::memcmp(shifted.dh.data(), all.dh.data() + 29 * H, (kM - 29) * H * sizeof(float)), 0);
    backward(0, 300, false, halves);
    backward(300, kM - 300, false, halves);
    std::vector<double> dw(all.dw.begin(), all.dw.end()), db(all.db.begin(), all.db.end());
    EXPECT_EQ(WithinRowTolerance(halves.dw, dw, V, H, "accumulated dL/dW"), "");
    EXPECT_EQ(WithinRowTolerance(halves.db, db, 1, V, "accumulated dL/db"), "");
  }
}

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
