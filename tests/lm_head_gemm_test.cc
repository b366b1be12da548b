// LmHeadGemm unit tests: oneDNN matmul against a float64 reference computed
// here from the exact (dtype-rounded) inputs, for each weight / hidden dtype
// pair and each --lm-head-precision (bf16, tf32, fp32; operands rounded here
// with frexp / ldexp, independently of the code under test);
// M-independence of rows; argument errors. DISABLED_Throughput prints
// GFLOP/s for a Llama-sized slice (run with --gtest_also_run_disabled_tests).
#include "worker/kernels/lm_head_gemm.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
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

/// Entries of out[M, N] farther from sum_k h[m, k] w[n, k] (float64) than
/// 1e-5 * sum_k |h w| + 1e-6 (f32 accumulation); reports the first 5 as
/// test failures when `report`.
int CountOutside(const std::vector<double>& h, const std::vector<double>& w, int64_t M, int64_t N, int64_t H,
                 const std::vector<float>& out, bool report) {
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
      if (!(std::fabs(got - ref) <= 1e-5 * mag + 1e-6) && ++bad <= 5 && report)
        ADD_FAILURE() << "out[" << m << ", " << n << "] = " << got << ", want " << ref << " (sum|hw| = " << mag << ")";
    }
  }
  return bad;
}

/// Checks out[M, N] against sum_k h[m, k] w[n, k] in float64, with
/// tolerance 1e-5 * sum_k |h w| + 1e-6 (f32 accumulation).
void ExpectClose(const std::vector<double>& h, const std::vector<double>& w, int64_t M, int64_t N, int64_t H,
                 const std::vector<float>& out) {
  EXPECT_EQ(CountOutside(h, w, M, N, H, out, true), 0);
}

/// What a GEMM over `wdt` weights [N, H] computing in `compute` holds:
/// the weights as given (no converted copy), and the last partial column
/// tile converted.
size_t HeldBytes(DType wdt, DType compute, int64_t N, int64_t H) {
  const size_t tail = N % kLmHeadTileCols ? static_cast<size_t>(kLmHeadTileCols * H) * DTypeSize(compute) : 0;
  return static_cast<size_t>(N * H) * DTypeSize(wdt) + tail;
}

/// Builds a GEMM over random `wdt` weights [N, H], runs it on random
/// `hdt` hidden states [M, H] and checks against the float64 reference.
/// `kernel`: the bf16 precision's kernel (kAuto: bf16 dot products where
/// oneDNN has them).
void RunCase(DType wdt, DType hdt, int64_t M, int64_t N, int64_t H, LmHeadCpuKernel kernel = LmHeadCpuKernel::kAuto) {
  SCOPED_TRACE(testing::Message() << DTypeName(wdt) << " weights, " << DTypeName(hdt) << " hidden, M=" << M
                                  << " N=" << N << " H=" << H << ", kernel " << LmHeadCpuKernelName(kernel));
  Tensor w = Random(wdt, N * H, 1 + N + H), h = Random(hdt, M * H, 7 + M);
  auto g = LmHeadGemm::Create(wdt, w.bytes, N, H, 0, LmHeadPrecision::kAuto, kernel);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->rows(), N);
  EXPECT_EQ((*g)->hidden_size(), H);
  // BF16 weights compute in bf16 where oneDNN can (unless the kernel is
  // widen), else in f32 on the same bf16 values.
  const DType compute =
      wdt == v1::BF16 && Bf16MatmulSupported() && kernel != LmHeadCpuKernel::kWiden ? v1::BF16 : v1::F32;
  EXPECT_EQ((*g)->compute_dtype(), compute);
  EXPECT_EQ((*g)->weight_bytes(), HeldBytes(wdt, compute, N, H));
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

// Both CPU kernels of the bf16 precision (common/lm_head_cpu_kernel.h)
// compute the same bf16 products with f32 accumulation: each within the
// f32-accumulation bound of the float64 reference, whatever M and dtype.
TEST(LmHeadGemm, EachBf16KernelMatchesFloat64) {
  std::vector<LmHeadCpuKernel> kernels = {LmHeadCpuKernel::kWiden};
  if (Bf16MatmulSupported()) kernels.push_back(LmHeadCpuKernel::kBf16);
  for (LmHeadCpuKernel k : kernels) {
    for (int64_t M : {1, 7, 64, 130}) RunCase(v1::BF16, v1::BF16, M, 1001, 256, k);
    RunCase(v1::BF16, v1::F32, 7, 1000, 100, k);
    RunCase(v1::BF16, v1::F16, 7, 1000, 100, k);
  }
}

// The kernel choice touches only the bf16 precision; a bf16 kernel this
// CPU lacks is refused, never replaced by another (other bits).
TEST(LmHeadGemm, KernelChoiceAppliesToTheBf16PrecisionOnly) {
  for (LmHeadPrecision p : {LmHeadPrecision::kTf32, LmHeadPrecision::kFp32})
    for (LmHeadCpuKernel k : {LmHeadCpuKernel::kAuto, LmHeadCpuKernel::kBf16, LmHeadCpuKernel::kWiden}) {
      auto c = GemmComputeDType(p, k);
      ASSERT_TRUE(c.ok()) << c.status();
      EXPECT_EQ(*c, v1::F32);
    }
  EXPECT_EQ(*GemmComputeDType(LmHeadPrecision::kBf16, LmHeadCpuKernel::kWiden), v1::F32);
  auto native = GemmComputeDType(LmHeadPrecision::kBf16, LmHeadCpuKernel::kBf16);
  if (Bf16MatmulSupported()) {
    EXPECT_EQ(*native, v1::BF16);
  } else {
    EXPECT_EQ(native.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(native.status().message().find("--lm-head-cpu-kernel widen"), std::string::npos) << native.status();
  }
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

TEST(LmHeadGemm, WeightsMappedFromAFileInMemoryGiveBitwiseTheOwnedWeightsLogits) {
  // A store file in /dev/shm: a worker maps its rows (HostBytes::MapMemoryFile)
  // at an offset that is not page-aligned, over a ragged last column tile.
  const int64_t N = 300, H = 96, M = 70;
  for (DType wdt : {v1::BF16, v1::F32}) {
    SCOPED_TRACE(DTypeName(wdt));
    Tensor w = Random(wdt, N * H, 11), h = Random(v1::BF16, M * H, 12);
    const std::string path = "/dev/shm/lm_head_gemm_test." + std::to_string(getpid());
    const size_t offset = 4096 + 3 * w.bytes.size() / static_cast<size_t>(N);  // after 3 rows of another slice
    {
      FILE* f = std::fopen(path.c_str(), "wb");
      ASSERT_NE(f, nullptr);
      const std::vector<char> before(offset, '\x7f');  // not zeros: the tail tile must not read past N
      std::fwrite(before.data(), 1, before.size(), f);
      std::fwrite(w.bytes.data(), 1, w.bytes.size(), f);
      std::fwrite(before.data(), 1, 4096, f);
      std::fclose(f);
    }
    absl::StatusOr<HostBytes> mapped = HostBytes::MapMemoryFile(path, offset, w.bytes.size());
    std::remove(path.c_str());                                                    // the mapping keeps the file's pages
    if (absl::IsUnimplemented(mapped.status())) GTEST_SKIP() << mapped.status();  // /dev/shm is not tmpfs here
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    ASSERT_TRUE(mapped->mapped());
    ASSERT_EQ(std::memcmp(mapped->data(), w.bytes.data(), w.bytes.size()), 0);
    auto owned = LmHeadGemm::Create(wdt, w.bytes, N, H), shared = LmHeadGemm::Create(wdt, *mapped, N, H);
    ASSERT_TRUE(owned.ok() && shared.ok());
    std::vector<float> a(M * N), b(M * N);
    ASSERT_TRUE((*owned)->Compute(v1::BF16, h.bytes.data(), M, a.data()).ok());
    ASSERT_TRUE((*shared)->Compute(v1::BF16, h.bytes.data(), M, b.data()).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
    ExpectClose(h.exact, w.exact, M, N, H, b);
  }
}

TEST(LmHeadGemm, WeightsConvertedPerTileGiveBitwiseTheLogitsOfPreConvertedWeights) {
  // Weights not in the operands' dtype are kept as given and converted one
  // column tile at a time inside Compute (no converted copy: issue 34). The
  // operands are the same as those of weights converted beforehand, so the
  // logits are the same bits: BF16 and F16 weights at fp32 precision against
  // the same values widened to F32 (whole tiles and a ragged last tile),
  // over M spanning a partial and several row tiles.
  const int64_t N = 3 * kLmHeadTileCols + 37, H = 80;
  for (DType wdt : {v1::BF16, v1::F16}) {
    SCOPED_TRACE(DTypeName(wdt));
    Tensor w = Random(wdt, N * H, 21);
    std::vector<char> wide(static_cast<size_t>(N * H) * 4);
    ToFloat(wdt, w.bytes.data(), static_cast<size_t>(N * H), reinterpret_cast<float*>(wide.data()));
    auto kept = LmHeadGemm::Create(wdt, w.bytes, N, H, 0, LmHeadPrecision::kFp32);
    auto widened = LmHeadGemm::Create(v1::F32, wide, N, H, 0, LmHeadPrecision::kFp32);
    ASSERT_TRUE(kept.ok() && widened.ok());
    EXPECT_EQ((*kept)->compute_dtype(), v1::F32);
    EXPECT_EQ((*kept)->weight_dtype(), wdt);
    EXPECT_EQ((*kept)->weight_bytes(), HeldBytes(wdt, v1::F32, N, H));  // no [N, H] f32 copy
    for (int64_t M : {1, 70, 130}) {
      Tensor h = Random(v1::F32, M * H, 22 + M);
      std::vector<float> a(M * N, NAN), b(M * N, NAN);
      ASSERT_TRUE((*kept)->Compute(v1::F32, h.bytes.data(), M, a.data()).ok());
      ASSERT_TRUE((*widened)->Compute(v1::F32, h.bytes.data(), M, b.data()).ok());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "M=" << M;
      ExpectClose(h.exact, w.exact, M, N, H, a);
    }
  }
}

TEST(HostBytes, MapsOnlyFilesInMemoryAndRangesInsideThem) {
  const std::string shm = "/dev/shm/host_bytes_test." + std::to_string(getpid());
  const std::string disk = "host_bytes_test." + std::to_string(getpid());  // the test's working directory
  for (const std::string& path : {shm, disk}) {
    FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr) << path;
    std::fwrite("0123456789", 1, 10, f);
    std::fclose(f);
  }
  absl::StatusOr<HostBytes> a = HostBytes::MapMemoryFile(shm, 3, 5);
  if (a.ok()) {
    const HostBytes copy = *a;  // shares the mapping
    a = HostBytes();
    EXPECT_TRUE(copy.mapped());
    EXPECT_EQ(std::string(copy.data(), copy.size()), "34567");
    EXPECT_EQ(HostBytes::MapMemoryFile(shm, 6, 5).status().code(), absl::StatusCode::kOutOfRange);
  } else {
    EXPECT_EQ(a.status().code(), absl::StatusCode::kUnimplemented) << a.status();
  }
  const absl::StatusOr<HostBytes> on_disk = HostBytes::MapMemoryFile(disk, 0, 10);
  if (!on_disk.ok()) {
    EXPECT_EQ(on_disk.status().code(), absl::StatusCode::kUnimplemented) << on_disk.status();
  }
  EXPECT_EQ(HostBytes::MapMemoryFile(shm + ".missing", 0, 1).status().code(), absl::StatusCode::kNotFound);
  const HostBytes owned(std::vector<char>{'a', 'b'});
  HostBytes moved = owned;
  EXPECT_FALSE(moved.mapped());
  EXPECT_EQ(std::string(moved.data(), moved.size()), "ab");
  std::remove(shm.c_str());
  std::remove(disk.c_str());
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

/// `v` rounded to `bits` significant bits (implicit bit included), round to
/// nearest even: 8 for bf16, 11 for tf32. Values here are normal floats.
std::vector<double> RoundSignificand(const std::vector<double>& v, int bits) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    int e = 0;
    const double m = std::frexp(v[i], &e);  // v = m 2^e, 0.5 <= |m| < 1
    r[i] = std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
  }
  return r;
}

/// Runs `precision` on random `wdt` weights [N, H] and `hdt` hidden states
/// [M, H]; returns the output and the exact operand values.
struct PrecisionRun {
  std::vector<float> out;
  std::vector<double> h, w;
  DType compute;
  LmHeadPrecision precision;
};
PrecisionRun RunPrecision(LmHeadPrecision precision, DType wdt, DType hdt, int64_t M, int64_t N, int64_t H) {
  Tensor w = Random(wdt, N * H, 11 + N), h = Random(hdt, M * H, 13 + M);
  auto g = LmHeadGemm::Create(wdt, w.bytes, N, H, /*threads=*/0, precision);
  EXPECT_TRUE(g.ok()) << g.status();
  PrecisionRun r{std::vector<float>(M * N, NAN), h.exact, w.exact, v1::DTYPE_UNSPECIFIED, LmHeadPrecision::kAuto};
  if (!g.ok()) return r;
  EXPECT_EQ((*g)->weight_bytes(), HeldBytes(wdt, (*g)->compute_dtype(), N, H));
  r.compute = (*g)->compute_dtype();
  r.precision = (*g)->precision();
  EXPECT_TRUE((*g)->Compute(hdt, h.bytes.data(), M, r.out.data()).ok());
  return r;
}

TEST(LmHeadPrecision, Fp32OfBf16WeightsKeepsF32HiddenStatesUnrounded) {
  const int64_t M = 7, N = 500, H = 256;
  const PrecisionRun fp32 = RunPrecision(LmHeadPrecision::kFp32, v1::BF16, v1::F32, M, N, H);
  EXPECT_EQ(fp32.precision, LmHeadPrecision::kFp32);
  EXPECT_EQ(fp32.compute, v1::F32);
  ExpectClose(fp32.h, fp32.w, M, N, H, fp32.out);
  // The same inputs under bf16 (explicit and auto) match the bf16-rounded
  // hidden states instead; and the two references are told apart.
  for (LmHeadPrecision p : {LmHeadPrecision::kBf16, LmHeadPrecision::kAuto}) {
    SCOPED_TRACE(LmHeadPrecisionName(p));
    const PrecisionRun bf16 = RunPrecision(p, v1::BF16, v1::F32, M, N, H);
    EXPECT_EQ(bf16.precision, LmHeadPrecision::kBf16);
    ExpectClose(RoundSignificand(bf16.h, 8), bf16.w, M, N, H, bf16.out);
    EXPECT_GT(CountOutside(bf16.h, bf16.w, M, N, H, bf16.out, false), M * N / 2);
  }
  EXPECT_GT(CountOutside(RoundSignificand(fp32.h, 8), fp32.w, M, N, H, fp32.out, false), M * N / 2);
}

TEST(LmHeadPrecision, Tf32RoundsBothF32OperandsToTf32) {
  const int64_t M = 9, N = 500, H = 256;
  const PrecisionRun r = RunPrecision(LmHeadPrecision::kTf32, v1::F32, v1::F32, M, N, H);
  EXPECT_EQ(r.precision, LmHeadPrecision::kTf32);
  EXPECT_EQ(r.compute, v1::F32);
  ExpectClose(RoundSignificand(r.h, 11), RoundSignificand(r.w, 11), M, N, H, r.out);
  EXPECT_GT(CountOutside(r.h, r.w, M, N, H, r.out, false), 0) << "tf32 rounding made no visible difference";
  // bf16 weights and hidden states are tf32 values already: exact operands.
  const PrecisionRun b = RunPrecision(LmHeadPrecision::kTf32, v1::BF16, v1::BF16, M, N, H);
  ExpectClose(b.h, b.w, M, N, H, b.out);
  // f16 hidden states too (10 explicit mantissa bits, as tf32).
  const PrecisionRun f = RunPrecision(LmHeadPrecision::kTf32, v1::F32, v1::F16, M, N, H);
  ExpectClose(f.h, RoundSignificand(f.w, 11), M, N, H, f.out);
}

TEST(LmHeadPrecision, Bf16RoundsF32AndF16WeightsAndHiddenStates) {
  const int64_t M = 5, N = 300, H = 100;
  for (DType wdt : {v1::F32, v1::F16}) {
    SCOPED_TRACE(DTypeName(wdt));
    const PrecisionRun r = RunPrecision(LmHeadPrecision::kBf16, wdt, v1::F32, M, N, H);
    EXPECT_EQ(r.precision, LmHeadPrecision::kBf16);
    EXPECT_EQ(r.compute, Bf16MatmulSupported() ? v1::BF16 : v1::F32);
    ExpectClose(RoundSignificand(r.h, 8), RoundSignificand(r.w, 8), M, N, H, r.out);
  }
}

TEST(LmHeadPrecision, AutoIsBf16ForBf16WeightsAndFp32Otherwise) {
  EXPECT_EQ(RunPrecision(LmHeadPrecision::kAuto, v1::F16, v1::F32, 2, 50, 32).precision, LmHeadPrecision::kFp32);
  EXPECT_EQ(RunPrecision(LmHeadPrecision::kAuto, v1::F32, v1::F32, 2, 50, 32).precision, LmHeadPrecision::kFp32);
  const PrecisionRun fp32 = RunPrecision(LmHeadPrecision::kFp32, v1::F16, v1::F32, 3, 70, 64);
  ExpectClose(fp32.h, fp32.w, 3, 70, 64, fp32.out);
}

TEST(LmHeadPrecision, RoundToTf32MatchesFrexpRounding) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1e3f, 1e3f);
  std::vector<double> v;
  for (int i = 0; i < 10000; ++i) v.push_back(u(rng));
  // Ties: exactly half an ulp of tf32 above an even and an odd significand.
  v.push_back(1.0 + std::ldexp(1.0, -11));      // -> 1.0 (even)
  v.push_back(1.0 + 3 * std::ldexp(1.0, -11));  // -> 1 + 2^-9 (even)
  v.push_back(-(1.0 + 3 * std::ldexp(1.0, -11)));
  const std::vector<double> want = RoundSignificand(v, 11);
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(RoundToTf32(static_cast<float>(v[i])), want[i]) << "x = " << v[i];
  EXPECT_EQ(want[want.size() - 3], 1.0);
  EXPECT_TRUE(std::isnan(RoundToTf32(NAN)));
  EXPECT_EQ(RoundToTf32(INFINITY), INFINITY);
  EXPECT_EQ(RoundToTf32(0.f), 0.f);
}

TEST(LmHeadPrecision, WorkerBytesAreWhatEachBackendHolds) {
  // CPU workers keep the checkpoint's dtype whatever the precision and CPU
  // (converted per tile: no copy); GPU workers hold the GEMM's operands.
  for (LmHeadPrecision p : {LmHeadPrecision::kAuto, LmHeadPrecision::kBf16, LmHeadPrecision::kFp32}) {
    EXPECT_EQ(LmHeadWorkerBytes(75968, 4096, v1::BF16, p, /*device=*/false), int64_t{75968} * 4096 * 2);
    EXPECT_EQ(LmHeadWorkerBytes(100, 8, v1::F32, p, false), 100 * 8 * 4);
  }
  EXPECT_EQ(LmHeadWorkerBytes(100, 8, v1::BF16, LmHeadPrecision::kAuto, /*device=*/true), 100 * 8 * 2);
  EXPECT_EQ(LmHeadWorkerBytes(100, 8, v1::BF16, LmHeadPrecision::kFp32, true), 100 * 8 * 4);
  EXPECT_EQ(LmHeadWorkerBytes(100, 8, v1::BF16, LmHeadPrecision::kTf32, true), 100 * 8 * 4);
  EXPECT_EQ(LmHeadWorkerBytes(100, 8, v1::F32, LmHeadPrecision::kBf16, true), 100 * 8 * 2);
  EXPECT_EQ(LmHeadWorkerBytes(100, 8, v1::F16, LmHeadPrecision::kAuto, true), 100 * 8 * 4);
}

TEST(LmHeadPrecision, ParseAndNames) {
  for (const char* name : {"auto", "bf16", "tf32", "fp32"}) {
    auto p = ParseLmHeadPrecision(name);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_STREQ(LmHeadPrecisionName(*p), name);
  }
  for (const char* bad : {"", "fp16", "FP32", "f32", "bfloat16"}) {
    auto p = ParseLmHeadPrecision(bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(p.status().message().find("--lm-head-precision"), std::string::npos) << p.status();
    EXPECT_NE(p.status().message().find("auto, bf16, tf32 or fp32"), std::string::npos) << p.status();
  }
  EXPECT_EQ(ResolveLmHeadPrecision(LmHeadPrecision::kAuto, v1::BF16), LmHeadPrecision::kBf16);
  EXPECT_EQ(ResolveLmHeadPrecision(LmHeadPrecision::kAuto, v1::F16), LmHeadPrecision::kFp32);
  EXPECT_EQ(ResolveLmHeadPrecision(LmHeadPrecision::kTf32, v1::BF16), LmHeadPrecision::kTf32);
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
