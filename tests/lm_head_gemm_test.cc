// LmHeadGemm unit tests: oneDNN matmul against a float64 reference computed
// here from the exact (dtype-rounded) inputs, for each weight / hidden dtype
// pair; M-independence of rows; argument errors. DISABLED_Throughput prints
// GFLOP/s for a Llama-sized slice (run with --gtest_also_run_disabled_tests).
#include "worker/kernels/lm_head_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace logprob::kernels {
namespace {

/// A tensor of `n` random values in [-1, 1): its bytes in `dtype` and the
/// exact values those bytes hold.
struct Tensor {
  std::vector<char> bytes;
  std::vector<double> exact;
};

Tensor Random(DType dtype, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Tensor t;
  t.bytes.resize(n * DTypeSize(dtype));
  std::vector<float> f(n);
  for (auto& x : f) x = u(rng);
  for (size_t i = 0; i < n; ++i) {
    uint16_t b;
    if (dtype == v1::F32) {
      std::memcpy(t.bytes.data() + 4 * i, &f[i], 4);
      continue;
    }
    b = dtype == v1::BF16 ? FloatToBf16(f[i]) : FloatToF16(f[i]);
    std::memcpy(t.bytes.data() + 2 * i, &b, 2);
  }
  std::vector<float> back(n);
  ToFloat(dtype, t.bytes.data(), n, back.data());
  t.exact.assign(back.begin(), back.end());
  return t;
}

/// Rounds exact values to bf16 (what a BF16-weight LmHeadGemm does to
/// hidden states of another dtype).
std::vector<double> RoundBf16(const std::vector<double>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = Bf16ToFloat(FloatToBf16(static_cast<float>(v[i])));
  return r;
}

/// Checks out[M, N] against sum_k h[m, k] w[n, k] in float64, with
/// tolerance 1e-5 * sum_k |h w| + 1e-6 (f32 accumulation).
void ExpectClose(const std::vector<double>& h, const std::vector<double>& w, int64_t M, int64_t N, int64_t H,
                 const std::vector<float>& out) {
  int bad = 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < H; ++k) {
        const double p = h[m * H + k] * w[n * H + k];
        ref += p;
        mag += std::fabs(p);
      }
      const double got = out[m * N + n];
      if (!(std::fabs(got - ref) <= 1e-5 * mag + 1e-6) && ++bad <= 5)
        ADD_FAILURE() << "out[" << m << ", " << n << "] = " << got << ", want " << ref << " (sum|hw| = " << mag << ")";
    }
  }
  EXPECT_EQ(bad, 0);
}

/// Builds a GEMM over random `wdt` weights [N, H], runs it on random
/// `hdt` hidden states [M, H] and checks against the float64 reference.
void RunCase(DType wdt, DType hdt, int64_t M, int64_t N, int64_t H) {
  SCOPED_TRACE(testing::Message() << DTypeName(wdt) << " weights, " << DTypeName(hdt) << " hidden, M=" << M
                                  << " N=" << N << " H=" << H);
  Tensor w = Random(wdt, N * H, 1 + N + H), h = Random(hdt, M * H, 7 + M);
  auto g = LmHeadGemm::Create(wdt, w.bytes, N, H);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->rows(), N);
  EXPECT_EQ((*g)->hidden_size(), H);
  // BF16 weights compute in bf16 where oneDNN can, else in f32 on the same bf16 values.
  const DType compute = wdt == v1::BF16 && Bf16MatmulSupported() ? v1::BF16 : v1::F32;
  EXPECT_EQ((*g)->compute_dtype(), compute);
  EXPECT_EQ((*g)->weight_bytes(), static_cast<size_t>(N * H) * DTypeSize(compute));
  std::vector<float> out(M * N, NAN);
  ASSERT_TRUE((*g)->Compute(hdt, h.bytes.data(), M, out.data()).ok());
  const bool round_h = wdt == v1::BF16 && hdt != v1::BF16;
  ExpectClose(round_h ? RoundBf16(h.exact) : h.exact, w.exact, M, N, H, out);
}

TEST(LmHeadGemm, Bf16WeightsBf16Hidden) {
  for (int64_t H : {256, 100})
    for (int64_t M : {1, 7, 64}) RunCase(v1::BF16, v1::BF16, M, 1000, H);
  RunCase(v1::BF16, v1::BF16, 7, 1001, 100);
}

TEST(LmHeadGemm, Bf16WeightsF32AndF16HiddenRoundToBf16) {
  RunCase(v1::BF16, v1::F32, 7, 1000, 256);
  RunCase(v1::BF16, v1::F16, 7, 1001, 100);
}

TEST(LmHeadGemm, F32WeightsF32Hidden) {
  for (int64_t M : {1, 7, 64}) RunCase(v1::F32, v1::F32, M, 1000, 256);
  RunCase(v1::F32, v1::F32, 7, 1001, 100);
}

TEST(LmHeadGemm, F32WeightsBf16Hidden) { RunCase(v1::F32, v1::BF16, 7, 1000, 100); }

TEST(LmHeadGemm, F16WeightsF32AndF16Hidden) {
  RunCase(v1::F16, v1::F32, 7, 1000, 256);
  RunCase(v1::F16, v1::F16, 64, 1001, 100);
}

TEST(LmHeadGemm, ReusesPrimitivesAcrossM) {
  // Alternating M on one object: each call must still match the reference.
  const int64_t N = 1000, H = 256;
  Tensor w = Random(v1::BF16, N * H, 3), h = Random(v1::BF16, 64 * H, 4);
  auto g = LmHeadGemm::Create(v1::BF16, w.bytes, N, H, /*threads=*/2);
  ASSERT_TRUE(g.ok()) << g.status();
  for (int64_t M : {64, 1, 7, 64, 1}) {
    std::vector<float> out(M * N);
    ASSERT_TRUE((*g)->Compute(v1::BF16, h.bytes.data(), M, out.data()).ok());
    ExpectClose(h.exact, w.exact, M, N, H, out);
  }
}

TEST(LmHeadGemm, ZeroRowsIsNoOp) {
  auto g = LmHeadGemm::Create(v1::F32, std::vector<char>(4 * 3 * 2), 3, 2);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE((*g)->Compute(v1::F32, nullptr, 0, nullptr).ok());
}

TEST(LmHeadGemm, Errors) {
  EXPECT_EQ(LmHeadGemm::Create(v1::BF16, std::vector<char>(2 * 3 * 4 - 2), 3, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LmHeadGemm::Create(v1::I64, std::vector<char>(8 * 3 * 4), 3, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LmHeadGemm::Create(v1::F32, {}, 0, 4).status().code(), absl::StatusCode::kInvalidArgument);
  auto g = LmHeadGemm::Create(v1::F32, std::vector<char>(4 * 3 * 4), 3, 4);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<float> h(4), out(3);
  EXPECT_EQ((*g)->Compute(v1::I64, h.data(), 1, out.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*g)->Compute(v1::F32, h.data(), -1, out.data()).code(), absl::StatusCode::kInvalidArgument);
}

/// Prints GFLOP/s (2 M N H / s, median of 5 after a warm-up) for a
/// [128, 4096] x [4096, 32000] lm_head in bf16 and f32. No assertions.
TEST(LmHeadGemm, DISABLED_Throughput) {
  const int64_t M = 128, N = 32000, H = 4096;
  for (DType dt : {v1::BF16, v1::F32}) {
    std::vector<char> w(N * H * DTypeSize(dt));
    for (size_t i = 0; i < w.size(); i += 2) w[i + 1] = 0x3c;  // small, finite
    Tensor h = Random(dt, M * H, 5);
    auto g = LmHeadGemm::Create(dt, std::move(w), N, H);
    ASSERT_TRUE(g.ok()) << g.status();
    std::vector<float> out(M * N);
    std::vector<double> secs;
    for (int i = 0; i < 6; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      ASSERT_TRUE((*g)->Compute(dt, h.bytes.data(), M, out.data()).ok());
      if (i > 0) secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(secs.begin(), secs.end());
    std::printf("%s M=%lld N=%lld H=%lld: median %.1f ms, %.1f GFLOP/s\n", DTypeName(dt), static_cast<long long>(M),
                static_cast<long long>(N), static_cast<long long>(H), secs[2] * 1e3, 2.0 * M * N * H / secs[2] * 1e-9);
  }
}

}  // namespace
}  // namespace logprob::kernels
