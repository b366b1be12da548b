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

#include "worker/kernels/lm_head_gemm.h"

namespace logprob::kernels {
namespace {

constexpr int64_t N = 70, H = 48, V = 300;  // two row tiles (one partial), three column tiles (one partial)

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Case {
  DType weight_dtype;
  LmHeadTransform transform;
  float temperature;
};

/// A random problem and its float64 reference.
struct Problem {
  std::vector<float> h;                          // [N, H]
  std::vector<float> w;                          // [V, H] as the GEMM sees it (bf16 values when BF16)
  std::vector<char> w_bytes;                     // [V, H] in the case's dtype
  std::vector<float> bias;                       // [V]
  std::vector<int64_t> targets;                  // [N], some -1
  std::vector<float> lse, entropy, g_lp, g_ent;  // [N]
  std::vector<double> dh, dw, db;                // references
};

Problem Make(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  Problem p;
  p.h.resize(N * H);
  for (auto& x : p.h) x = normal(rng);
  p.w.resize(V * H);
  for (auto& x : p.w) x = 0.3f * normal(rng);
  if (c.weight_dtype == v1::BF16) {
    std::vector<uint16_t> b(V * H);
    for (int64_t i = 0; i < V * H; ++i) {
      b[i] = ToBf16(p.w[i]);
      p.w[i] = FromBf16(b[i]);
    }
    p.w_bytes.assign(reinterpret_cast<char*>(b.data()), reinterpret_cast<char*>(b.data()) + b.size() * 2);
  } else {
    p.w_bytes.assign(reinterpret_cast<char*>(p.w.data()), reinterpret_cast<char*>(p.w.data()) + p.w.size() * 4);
  }
  p.bias.resize(V);
  for (auto& x : p.bias) x = 0.5f * normal(rng);
  p.targets.resize(N);
  for (int64_t i = 0; i < N; ++i) p.targets[i] = i % 9 == 4 ? -1 : static_cast<int64_t>(rng() % V);
  p.g_lp.resize(N);
  p.g_ent.resize(N);
  for (int64_t i = 0; i < N; ++i) {
    p.g_lp[i] = normal(rng);
    p.g_ent[i] = 0.5f * normal(rng);
  }
  // float64 forward and backward.
  const LmHeadTransform& t = c.transform;
  const double T = c.temperature, scale = t.logit_scale, cap = t.softcap;
  p.lse.resize(N);
  p.entropy.resize(N);
  p.dh.assign(N * H, 0.0);
  p.dw.assign(V * H, 0.0);
  p.db.assign(V, 0.0);
  std::vector<double> z(V), x(V), gy(V);
  for (int64_t i = 0; i < N; ++i) {
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      double y = 0;
      for (int64_t k = 0; k < H; ++k) y += static_cast<double>(p.h[i * H + k]) * p.w[v * H + k];
      double zz = (y + (t.has_bias ? p.bias[v] : 0.0)) * scale;
      if (cap != 0) zz = cap * std::tanh(zz / cap);
      z[v] = zz;
      x[v] = zz / T;
      mx = std::max(mx, x[v]);
    }
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[v] - mx);
    const double lse = mx + std::log(s);
    double ent = lse;
    for (int64_t v = 0; v < V; ++v) ent -= std::exp(x[v] - lse) * x[v];
    p.lse[i] = static_cast<float>(lse);
    p.entropy[i] = static_cast<float>(ent);
    const double g_lp = p.targets[i] >= 0 ? p.g_lp[i] : 0.0, g_ent = p.g_ent[i];
    for (int64_t v = 0; v < V; ++v) {
      const double pv = std::exp(x[v] - lse);
      double gx = -g_lp * pv - g_ent * pv * (x[v] - lse + ent);
      if (v == p.targets[i]) gx += g_lp;
      double g = gx / T * scale;
      if (cap != 0) g *= 1 - (z[v] / cap) * (z[v] / cap);
      gy[v] = g;
      p.db[v] += g;
      for (int64_t k = 0; k < H; ++k) {
        p.dh[i * H + k] += g * p.w[v * H + k];
        p.dw[v * H + k] += g * p.h[i * H + k];
      }
    }
  }
  return p;
}

/// The kernel's gradients over `slices` equal slices of the vocabulary:
/// dL/dh summed over the slices in order, dL/dW and dL/db concatenated.
struct Grads {
  std::vector<float> dh, dw, db;
};

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

/// Every element of `got` [n, width] within 1e-4 of its row's largest
/// |reference| plus 1e-7; the first failure, or "".
std::string WithinRowTolerance(const std::vector<float>& got, const std::vector<double>& want, int64_t n, int64_t width,
                               const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    double row_max = 0;
    for (int64_t k = 0; k < width; ++k) row_max = std::max(row_max, std::abs(want[i * width + k]));
    for (int64_t k = 0; k < width; ++k) {
      const double err = std::abs(got[i * width + k] - want[i * width + k]);
      if (!(err <= 1e-4 * row_max + 1e-7))
        return std::string(what) + " row " + std::to_string(i) + " col " + std::to_string(k) + ": got " +
               std::to_string(got[i * width + k]) + " want " + std::to_string(want[i * width + k]);
    }
  }
  return "";
}

class HeadBackward : public ::testing::TestWithParam<std::tuple<int, int>> {};

const Case kCases[] = {
    {v1::F32, LmHeadTransform{}, 1.0f},
    {v1::BF16, LmHeadTransform{}, 0.7f},
    {v1::F32, LmHeadTransform{true, 1.5, 0.0}, 0.7f},
    {v1::BF16, LmHeadTransform{true, 0.8, 5.0}, 1.0f},
};

TEST_P(HeadBackward, GradientsMatchFloat64) {
  const auto [case_index, slices] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 100 + case_index);
  const Grads g = Backward(c, p, slices, 0, N);
  EXPECT_EQ(WithinRowTolerance(g.dh, p.dh, N, H, "dL/dh"), "");
  EXPECT_EQ(WithinRowTolerance(g.dw, p.dw, V, H, "dL/dW"), "");
  EXPECT_EQ(WithinRowTolerance(g.db, p.db, 1, V, "dL/db"), "");
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
