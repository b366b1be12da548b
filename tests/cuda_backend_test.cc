// CUDA backend against the CPU backend and a float64 reference: packed
// partial records of random rows (bf16 / f16 / f32, V = 151936 with top-k,
// ties at the top-k threshold, vocabulary slices, K > slice length, -inf
// rows), sampling filters, the cuBLASLt hidden-states path, and the
// one-pass path on ranks sharing one GPU over device collectives staged
// through host memory. Every test skips (GTEST_SKIP) on a machine without
// a usable CUDA device.
#include "worker/cuda/cuda_backend.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/lm_head_precision.h"
#include "common/partition.h"
#include "tests/in_process_communicator.h"
#include "worker/comm/host_staged_device_collectives.h"
#include "worker/cuda/converting_upload.h"
#include "worker/cuda/cuda_device_copy.h"
#include "worker/cuda/cuda_ipc.h"
#include "worker/cuda/device_buffers.h"
#include "worker/cuda/device_info.h"
#include "worker/cuda/elem_type.h"
#include "worker/cuda/lm_head_gemm_cublaslt.h"
#include "worker/heads/device_file_copy.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/kernels/row_stats.h"
#include "worker/scoring/cpu_backend.h"
#include "worker/scoring/one_pass_layout.h"

namespace logprob {
namespace {

using kernels::StatsSpec;

#define SKIP_WITHOUT_GPU()                                                           \
  do {                                                                               \
    if (auto n = cuda::DeviceCount(); !n.ok()) GTEST_SKIP() << n.status().message(); \
  } while (0)

enum class Values { kNormal, kSmallIntegers, kMinusInf };

/// `entropy` also asks for log_sum_sq_probs, mean_logits and is_top1 (their
/// record fields q, zsum and pre_target_max).
StatsSpec Spec(int topk, int gather_k, bool entropy, float temperature = 1.0f) {
  StatsSpec s;
  s.topk = topk;
  s.gather_k = gather_k;
  s.entropy = entropy;
  s.log_sum_sq_probs = entropy;
  s.mean_logits = entropy;
  s.is_top1 = entropy;
  s.temperature = temperature;
  return s;
}

/// n rows of len logits of `dtype` with targets and gather ids in [0, V).
struct Rows {
  DType dtype;
  int64_t n, len, vocab_begin, V;
  std::vector<char> bytes;
  std::vector<float> values;  // the exact values (after dtype rounding)
  std::vector<int64_t> targets, gather;
  BlockRows block(int gather_k) const { return BlockRows{n, targets.data(), gather_k ? gather.data() : nullptr}; }
  LogitsBlock logits() const { return LogitsBlock{dtype, bytes.data(), vocab_begin, len}; }
};

/// `values` encoded as `dtype` (F32 as is; BF16 and F16 rounded to
/// nearest even): the host conversion of weights.
std::vector<char> Encode(const std::vector<float>& values, DType dtype) {
  std::vector<char> out(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == v1::F32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == v1::F16 ? FloatToF16(values[i]) : FloatToBf16(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

Rows MakeRows(DType dtype, int64_t n, int64_t len, int64_t vocab_begin, int64_t V, int gather_k, Values kind,
              uint32_t seed) {
  Rows r{dtype, n, len, vocab_begin, V, {}, {}, {}, {}};
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_int_distribution<int64_t> id(0, V - 1);
  std::vector<float> drawn(static_cast<size_t>(n * len));
  for (float& f : drawn)
    f = kind == Values::kNormal ? normal(gen) : kind == Values::kSmallIntegers ? float(small(gen)) : -INFINITY;
  r.bytes = Encode(drawn, dtype);
  r.values.resize(drawn.size());
  ToFloat(dtype, r.bytes.data(), drawn.size(), r.values.data());
  for (int64_t i = 0; i < n; ++i) r.targets.push_back(i == 1 ? -1 : id(gen));
  for (int64_t i = 0; i < n * gather_k; ++i) r.gather.push_back(id(gen));
  return r;
}

float F(uint32_t w) {
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
double D(const uint32_t* w) {
  double d;
  std::memcpy(&d, w, 8);
  return d;
}

/// m, target x, pre_target_max, gather x and the top-k are bitwise the CPU
/// kernel's; s, u, q and zsum agree within float32 summation rounding.
void ExpectRecordsMatch(const std::vector<uint32_t>& cpu, const std::vector<uint32_t>& gpu, int64_t rows,
                        const StatsSpec& spec) {
  const size_t words = kernels::PartialWords(spec);
  ASSERT_EQ(cpu.size(), gpu.size());
  for (int64_t r = 0; r < rows; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    const uint32_t* c = cpu.data() + r * words;
    const uint32_t* g = gpu.data() + r * words;
    constexpr int m = record::kMaxWord, t = record::kTargetWord, s = record::kSWord, u = record::kUWord;
    EXPECT_EQ(c[m], g[m]) << "m " << F(c[m]) << " vs " << F(g[m]);
    EXPECT_EQ(c[t], g[t]) << "target x " << F(c[t]) << " vs " << F(g[t]);
    const double cs = D(c + s), gs = D(g + s);
    EXPECT_NEAR(cs, gs, 2e-5 * cs) << "s";
    if (spec.entropy) {
      EXPECT_NEAR(D(c + u), D(g + u), 2e-5 * (std::abs(D(c + u)) + cs)) << "u";
    }
    constexpr int q = record::kQWord, z = record::kZSumWord, ptm = record::kPreTargetMaxWord;
    EXPECT_NEAR(D(c + q), D(g + q), 2e-5 * D(c + q)) << "q";
    if (std::isinf(D(c + z))) {
      EXPECT_EQ(D(c + z), D(g + z)) << "zsum";
    } else {
      // Sums of float32 partial sums in another order; mean_logits divides
      // the difference by V (>= 10 here).
      EXPECT_NEAR(D(c + z), D(g + z), 1e-2 + 1e-5 * std::abs(D(c + z))) << "zsum";
    }
    EXPECT_EQ(c[ptm], g[ptm]) << "pre_target_max " << F(c[ptm]) << " vs " << F(g[ptm]);
    EXPECT_EQ(c[record::kReservedWord], g[record::kReservedWord]);
    for (size_t w = record::kHeaderWords; w < words; ++w)
      EXPECT_EQ(c[w], g[w]) << "word " << w << ": " << F(c[w]) << " vs " << F(g[w]);
  }
}

/// float64 reference of one full row (x = values / temperature).
struct Reference {
  double logZ, entropy;
  std::vector<int64_t> topk;
};
Reference Ref(const float* v, int64_t V, float temperature, int K) {
  std::vector<float> x(V);
  for (int64_t i = 0; i < V; ++i) x[i] = v[i] / temperature;
  const double m = *std::max_element(x.begin(), x.end());
  double s = 0, sx = 0;
  for (float a : x) {
    const double e = std::exp(a - m);
    s += e;
    sx += e * (a - m);
  }
  Reference r{m + std::log(s), std::log(s) - sx / s, {}};
  std::vector<int64_t> ids(V);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  r.topk.assign(ids.begin(), ids.begin() + std::min<int64_t>(K, V));
  return r;
}

struct Backends {
  std::unique_ptr<CpuBackend> cpu = std::make_unique<CpuBackend>();
  std::unique_ptr<cuda::CudaBackend> gpu;
};
Backends Make() {
  Backends b;
  auto g = cuda::CudaBackend::Create(0);
  EXPECT_TRUE(g.ok()) << g.status();
  if (g.ok()) b.gpu = std::move(*g);
  return b;
}

void CompareSlice(const Rows& rows, const StatsSpec& spec) {
  Backends b = Make();
  ASSERT_TRUE(b.gpu);
  const size_t words = kernels::PartialWords(spec);
  std::vector<uint32_t> cpu(rows.n * words), gpu(rows.n * words);
  ASSERT_TRUE(b.cpu->SlicePartials(rows.logits(), rows.block(spec.gather_k), spec, cpu.data()).ok());
  const auto st = b.gpu->SlicePartials(rows.logits(), rows.block(spec.gather_k), spec, gpu.data());
  ASSERT_TRUE(st.ok()) << st;
  ExpectRecordsMatch(cpu, gpu, rows.n, spec);
}

TEST(CudaRecords, Bf16Vocab151936WithEntropyTop20AndGather) {
  SKIP_WITHOUT_GPU();
  const Rows rows = MakeRows(v1::BF16, 6, 151936, 0, 151936, 4, Values::kNormal, 1);
  const StatsSpec spec = Spec(20, 4, true, 0.7f);
  CompareSlice(rows, spec);
  // Outputs of the GPU records against float64.
  Backends b = Make();
  std::vector<uint32_t> rec(rows.n * kernels::PartialWords(spec));
  ASSERT_TRUE(b.gpu->SlicePartials(rows.logits(), rows.block(4), spec, rec.data()).ok());
  for (int64_t r = 0; r < rows.n; ++r) {
    float lp = 0, ent = 0, tl[20], g[4];
    int64_t ti[20];
    const uint32_t* p = rec.data() + r * kernels::PartialWords(spec);
    kernels::CombinePartials(&p, 1, spec, rows.targets[r] >= 0, {&lp, &ent, tl, ti, g});
    const Reference ref = Ref(rows.values.data() + r * rows.len, rows.len, spec.temperature, 20);
    const auto x = [&](int64_t id) { return double(rows.values[r * rows.len + id] / spec.temperature); };
    const auto tol = [](double e) { return 2e-4 + 2e-5 * std::abs(e); };
    if (rows.targets[r] >= 0) {
      EXPECT_NEAR(lp, x(rows.targets[r]) - ref.logZ, tol(x(rows.targets[r]) - ref.logZ));
    }
    EXPECT_NEAR(ent, ref.entropy, tol(ref.entropy));
    for (int j = 0; j < 20; ++j) {
      EXPECT_EQ(ti[j], ref.topk[j]) << j;
      EXPECT_NEAR(tl[j], x(ref.topk[j]) - ref.logZ, tol(x(ref.topk[j]) - ref.logZ));
    }
    for (int j = 0; j < 4; ++j) EXPECT_NEAR(g[j], x(rows.gather[r * 4 + j]) - ref.logZ, 1e-3);
  }
}

TEST(CudaRecords, TiesAtTheTopkThresholdGoByLowerId) {
  SKIP_WITHOUT_GPU();
  const StatsSpec spec = Spec(50, 0, true);
  for (DType dt : {v1::F32, v1::BF16, v1::F16}) {
    SCOPED_TRACE(DTypeName(dt));
    CompareSlice(MakeRows(dt, 5, 5000, 0, 5000, 0, Values::kSmallIntegers, 2), spec);
  }
}

TEST(CudaRecords, F16SliceOffsetUnalignedTargetsInAndOutOfSlice) {
  SKIP_WITHOUT_GPU();
  const StatsSpec spec = Spec(7, 3, true);
  // Odd slice length: rows after the first start unaligned (scalar head).
  CompareSlice(MakeRows(v1::F16, 9, 777, 1000, 3000, 3, Values::kNormal, 3), spec);
  CompareSlice(MakeRows(v1::F32, 9, 1001, 13, 3000, 3, Values::kNormal, 4), spec);
}

TEST(CudaRecords, SliceShorterThanKAndAllMinusInfRows) {
  SKIP_WITHOUT_GPU();
  const StatsSpec spec = Spec(50, 0, true);
  CompareSlice(MakeRows(v1::BF16, 3, 30, 70, 100, 0, Values::kNormal, 5), spec);
  CompareSlice(MakeRows(v1::F32, 2, 300, 0, 300, 0, Values::kMinusInf, 6), spec);
}

TEST(CudaRecords, ManyRowsAcrossStagingSubBlocks) {
  SKIP_WITHOUT_GPU();
  // 64 KiB staging: several sub-blocks alternate between the two buffers.
  cuda::CudaBackend::Options opts;
  opts.staging_bytes = 64 << 10;
  auto gpu = cuda::CudaBackend::Create(0, opts);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const Rows rows = MakeRows(v1::BF16, 40, 9000, 0, 9000, 2, Values::kNormal, 7);
  const StatsSpec spec = Spec(5, 2, false);
  const size_t words = kernels::PartialWords(spec);
  std::vector<uint32_t> cpu(rows.n * words), got(rows.n * words);
  ASSERT_TRUE(CpuBackend().SlicePartials(rows.logits(), rows.block(2), spec, cpu.data()).ok());
  ASSERT_TRUE((*gpu)->SlicePartials(rows.logits(), rows.block(2), spec, got.data()).ok());
  ExpectRecordsMatch(cpu, got, rows.n, spec);
}

TEST(CudaFilters, TopKTopPAndBothMatchTheCpuFilter) {
  SKIP_WITHOUT_GPU();
  Backends b = Make();
  ASSERT_TRUE(b.gpu);
  const StatsSpec spec = Spec(10, 0, true, 0.9f);
  for (const SamplingFilter f : {SamplingFilter{50, 1.0f}, SamplingFilter{0, 0.5f}, SamplingFilter{50, 0.9f},
                                 SamplingFilter{1, 1.0f}, SamplingFilter{0, 0.01f}}) {
    for (Values kind : {Values::kNormal, Values::kSmallIntegers}) {
      SCOPED_TRACE("top_k " + std::to_string(f.top_k) + " top_p " + std::to_string(f.top_p));
      const Rows rows = MakeRows(v1::BF16, 4, 32000, 0, 32000, 0, kind, 8);
      const size_t words = kernels::PartialWords(spec);
      std::vector<uint32_t> cpu(rows.n * words), gpu(rows.n * words);
      ASSERT_TRUE(b.cpu->FilteredRowPartials(rows.logits(), rows.block(0), spec, f, cpu.data()).ok());
      ASSERT_TRUE(b.gpu->FilteredRowPartials(rows.logits(), rows.block(0), spec, f, gpu.data()).ok());
      ExpectRecordsMatch(cpu, gpu, rows.n, spec);
    }
  }
}

/// Random bf16 [rows, H] as an lm_head slice.
LmHeadSlice RandomSlice(int64_t rows, int64_t H, uint32_t seed) {
  const Rows r = MakeRows(v1::BF16, rows, H, 0, 1, 0, Values::kNormal, seed);
  LmHeadSlice s;
  s.dtype = v1::BF16;
  s.rows = rows;
  s.hidden_size = H;
  std::vector<char> w = r.bytes;
  for (size_t i = 0; i < w.size(); i += 2) {  // scale to normal(0, ~0.05)
    uint16_t h;
    std::memcpy(&h, w.data() + i, 2);
    h = FloatToBf16(Bf16ToFloat(h) / 64.f);
    std::memcpy(w.data() + i, &h, 2);
  }
  s.weight = std::move(w);
  return s;
}

/// RandomSlice with a bias, a multiplier of 40 and a softcap of 30 (logits
/// of std ~30: the softcap matters).
LmHeadSlice TransformedSlice(int64_t rows, int64_t H, uint32_t seed) {
  LmHeadSlice slice = RandomSlice(rows, H, seed);
  slice.transform = LmHeadTransform{true, 40.0, 30.0};
  slice.bias.resize(rows);
  for (int64_t n = 0; n < rows; ++n) slice.bias[n] = 0.01f * static_cast<float>(n % 97) - 0.5f;
  return slice;
}

TEST(CudaHidden, AReleasedVersionsDeviceBufferTakesTheNextVersionOfItsSize) {
  // Issue 34: no cudaMalloc per version. Version 2 is loaded into the buffer
  // version 1 left, and scores with its own weights (the CPU's logits).
  SKIP_WITHOUT_GPU();
  const int64_t N = 1000, H = 128, M = 9;
  auto gpu = cuda::CudaBackend::Create(0, {});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto v1w = (*gpu)->LoadLmHead(RandomSlice(N, H, 1), LmHeadPrecision::kAuto);
  ASSERT_TRUE(v1w.ok()) << v1w.status();
  const cuda::DeviceRecycler& buffers = (*gpu)->lm_head_buffers();
  EXPECT_EQ(buffers.allocated(), 1u);
  v1w->reset();  // released: its buffer is kept for the next version
  // (the GEMM's rows: N rounded up to kLogitsAlign, zero rows past N)
  const int64_t padded = (N + cuda::CublasLtLmHead::kLogitsAlign - 1) / cuda::CublasLtLmHead::kLogitsAlign *
                         cuda::CublasLtLmHead::kLogitsAlign;
  EXPECT_EQ(buffers.idle_bytes(), static_cast<size_t>(padded * H) * 2);
  const LmHeadSlice slice2 = RandomSlice(N, H, 2);
  auto v2w = (*gpu)->LoadLmHead(slice2, LmHeadPrecision::kAuto);
  ASSERT_TRUE(v2w.ok()) << v2w.status();
  EXPECT_EQ(buffers.allocated(), 1u);
  EXPECT_EQ(buffers.reused(), 1u);
  CpuBackend cpu;
  auto cw = cpu.LoadLmHead(slice2, LmHeadPrecision::kAuto);
  ASSERT_TRUE(cw.ok()) << cw.status();
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 2, Values::kNormal, 3);
  std::vector<float> lc(M * N), lg(M * N);
  ASSERT_TRUE(cpu.HiddenLogits(**cw, v1::BF16, hidden.bytes.data(), M, lc.data()).ok());
  ASSERT_TRUE((*gpu)->HiddenLogits(**v2w, v1::BF16, hidden.bytes.data(), M, lg.data()).ok());
  for (size_t i = 0; i < lc.size(); ++i) ASSERT_NEAR(lc[i], lg[i], 1e-4 * (1 + std::abs(lc[i]))) << i;
  // Another size (past the padding) allocates.
  auto other = (*gpu)->LoadLmHead(RandomSlice(padded + 1, H, 4), LmHeadPrecision::kAuto);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(buffers.allocated(), 2u);
  // Issue 50: the vocabulary changed; once no version holds the old size,
  // its buffer is freed, not kept idle for good.
  v2w->reset();
  EXPECT_EQ(buffers.idle_bytes(), 0u);
}

// Issue 34: weights in another dtype than the GEMM's are converted on the
// device, through a staging buffer of a few elements here (chunks that do
// not divide n), into the bytes the host conversion gives: bf16 round to
// nearest even (ties, subnormals, overflow to inf), f32 exact.
TEST(CudaUpload, ConvertedWeightsAreTheHostConversionsBytes) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 1003;
  std::mt19937 rng(41);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  // bf16 ties (even and odd mantissa), f32 subnormals, values near bf16's
  // largest and past it, and zeros of both signs.
  const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x00000001u, 0x007fffffu,
                               0x7f7f7fffu, 0x7f7fffffu, 0x80000000u, 0x00000000u};
  for (size_t i = 0; i < std::size(specials); ++i) std::memcpy(&values[i * 97], &specials[i], 4);
  for (DType src_dtype : {v1::F32, v1::F16, v1::BF16}) {
    const std::vector<char> src = Encode(values, src_dtype);
    std::vector<float> wide(n);
    ToFloat(src_dtype, src.data(), n, wide.data());
    for (DType dst_dtype : {v1::BF16, v1::F32}) {
      SCOPED_TRACE(std::string(DTypeName(src_dtype)) + " -> " + DTypeName(dst_dtype));
      const std::vector<char> want = Encode(wide, dst_dtype);
      const size_t size = DTypeSize(dst_dtype);
      void* dst = nullptr;
      void* staging = nullptr;
      ASSERT_EQ(cudaMalloc(&dst, want.size()), cudaSuccess);
      const size_t staging_bytes = 7 * DTypeSize(src_dtype) + 1;  // 7 elements a chunk
      ASSERT_EQ(cudaMalloc(&staging, staging_bytes), cudaSuccess);
      const absl::Status st = cuda::UploadConverted(src.data(), cuda::ElemTypeOf(src_dtype), n, dst,
                                                    cuda::ElemTypeOf(dst_dtype), staging, staging_bytes);
      std::vector<char> got(want.size());
      ASSERT_EQ(cudaMemcpy(got.data(), dst, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      cudaFree(dst);
      cudaFree(staging);
      ASSERT_TRUE(st.ok()) << st;
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::memcmp(got.data() + i * size, want.data() + i * size, size), 0)
            << "element " << i << " (" << wide[i] << ")";
    }
  }
}

// The argument checks come before any CUDA call: they hold on a machine
// without a GPU too (this test does not skip).
TEST(CudaUpload, BadArgumentsAreInvalidArgumentBeforeAnyCudaCall) {
  const float values[4] = {1, 2, 3, 4};
  char staging[3];
  const absl::Status small =
      cuda::UploadConverted(values, cuda::ElemType::kF32, 4, staging, cuda::ElemType::kBF16, staging, sizeof staging);
  EXPECT_EQ(small.code(), absl::StatusCode::kInvalidArgument) << small;
  EXPECT_NE(small.message().find("3 staging bytes hold no element of 4 bytes"), std::string::npos) << small;
  EXPECT_EQ(cuda::UploadConverted(values, cuda::ElemType::kF32, -1, staging, cuda::ElemType::kBF16, staging, 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::UploadConverted(values, cuda::ElemType::kF32, 4, staging, cuda::ElemType::kF16, staging, 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cuda::UploadConverted(values, cuda::ElemType::kF32, 0, nullptr, cuda::ElemType::kBF16, nullptr, 0).ok());
  EXPECT_EQ(cuda::UploadStagingBytes(size_t{1} << 30), size_t{64} << 20);
  EXPECT_EQ(cuda::UploadStagingBytes(1000), 1000u);
}

// A version whose weights are converted on upload (BF16 at fp32, F32 and
// F16 at bf16) scores the bits of the same weights converted on the host
// first, and the next version of its size takes the released weight and
// staging buffers: no cudaMalloc per version.
TEST(CudaHidden, AConvertingLoadScoresTheHostConvertedWeightsAndAllocatesOnce) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 1000, H = 128, M = 9;
  const Rows hidden = MakeRows(v1::F32, M, H, 0, N, 0, Values::kNormal, 43);
  std::vector<float> wide(N * H);
  const LmHeadSlice base = RandomSlice(N, H, 44);
  ToFloat(v1::BF16, base.weight.data(), wide.size(), wide.data());
  for (float& w : wide) w *= 1.001f;  // not exactly bf16 any more
  struct Case {
    DType dtype;
    LmHeadPrecision precision;
    DType gemm_dtype;  // what the conversion gives
  };
  for (const Case c : {Case{v1::BF16, LmHeadPrecision::kFp32, v1::F32}, Case{v1::F32, LmHeadPrecision::kBf16, v1::BF16},
                       Case{v1::F16, LmHeadPrecision::kBf16, v1::BF16}}) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)) + " at " + LmHeadPrecisionName(c.precision));
    auto gpu = cuda::CudaBackend::Create(0, {});
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    const cuda::DeviceRecycler& buffers = (*gpu)->lm_head_buffers();
    const cuda::DeviceRecycler& staging = (*gpu)->lm_head_staging();
    LmHeadSlice slice{c.dtype, Encode(wide, c.dtype), N, H};
    std::vector<float> f(wide.size());  // the slice's values, then on the host
    ToFloat(c.dtype, slice.weight.data(), f.size(), f.data());
    LmHeadSlice host{c.gemm_dtype, Encode(f, c.gemm_dtype), N, H};
    const size_t slice_bytes = slice.weight.size();
    auto v1w = (*gpu)->LoadLmHead(std::move(slice), c.precision);
    ASSERT_TRUE(v1w.ok()) << v1w.status();
    EXPECT_EQ(buffers.allocated(), 1u);
    EXPECT_EQ(staging.allocated(), 1u);
    EXPECT_EQ(staging.idle_bytes(), slice_bytes);  // given back at once
    v1w->reset();
    auto v2w = (*gpu)->LoadLmHead(LmHeadSlice{c.dtype, Encode(wide, c.dtype), N, H}, c.precision);
    ASSERT_TRUE(v2w.ok()) << v2w.status();
    EXPECT_EQ(buffers.allocated(), 1u);
    EXPECT_EQ(buffers.reused(), 1u);
    EXPECT_EQ(staging.allocated(), 1u);
    EXPECT_EQ(staging.reused(), 1u);
    auto hw = (*gpu)->LoadLmHead(std::move(host), c.precision);
    ASSERT_TRUE(hw.ok()) << hw.status();
    EXPECT_EQ(staging.idle_bytes(), 0u);  // a load that converts nothing frees it (issue 50)
    std::vector<float> a(M * N), b(M * N);
    ASSERT_TRUE((*gpu)->HiddenLogits(**v2w, v1::F32, hidden.bytes.data(), M, a.data()).ok());
    ASSERT_TRUE((*gpu)->HiddenLogits(**hw, v1::F32, hidden.bytes.data(), M, b.data()).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
  }
}

TEST(CudaHidden, FusedGemmAndPartialsMatchTheCpuPath) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 3000, H = 256, M = 70;
  LmHeadSlice slice = RandomSlice(N, H, 9);
  cuda::CudaBackend::Options opts;
  opts.gemm_chunk_bytes = 16 * N * 4;  // chunks of 16 rows
  auto gpu = cuda::CudaBackend::Create(0, opts);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto gw = (*gpu)->LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(gw.ok()) << gw.status();
  CpuBackend cpu;
  auto cw = cpu.LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(cw.ok()) << cw.status();
  for (DType hdt : {v1::BF16, v1::F32, v1::F16}) {
    SCOPED_TRACE(DTypeName(hdt));
    const Rows hidden = MakeRows(hdt, M, H, 0, N, 2, Values::kNormal, 10);
    // Logits: f32 GEMMs agree within accumulation-order rounding.
    std::vector<float> lc(M * N), lg(M * N);
    ASSERT_TRUE(cpu.HiddenLogits(**cw, hdt, hidden.bytes.data(), M, lc.data()).ok());
    ASSERT_TRUE((*gpu)->HiddenLogits(**gw, hdt, hidden.bytes.data(), M, lg.data()).ok());
    for (size_t i = 0; i < lc.size(); ++i) ASSERT_NEAR(lc[i], lg[i], 1e-4 * (1 + std::abs(lc[i]))) << i;
    const StatsSpec spec = Spec(5, 2, true);
    const size_t words = kernels::PartialWords(spec);
    std::vector<uint32_t> rc(M * words), rg(M * words);
    ASSERT_TRUE(cpu.HiddenPartials(**cw, hdt, hidden.bytes.data(), 0, hidden.block(2), spec, rc.data()).ok());
    ASSERT_TRUE((*gpu)->HiddenPartials(**gw, hdt, hidden.bytes.data(), 0, hidden.block(2), spec, rg.data()).ok());
    for (int64_t r = 0; r < M; ++r) {
      float a[2], b[2], ta[5], tb[5], ga[2], gb[2];
      int64_t ia[5], ib[5];
      const uint32_t* pc = rc.data() + r * words;
      const uint32_t* pg = rg.data() + r * words;
      const bool has_target = hidden.targets[r] >= 0;
      kernels::CombinePartials(&pc, 1, spec, has_target, {&a[0], &a[1], ta, ia, ga});
      kernels::CombinePartials(&pg, 1, spec, has_target, {&b[0], &b[1], tb, ib, gb});
      for (int j = 0; j < 2; ++j) EXPECT_NEAR(a[j], b[j], 2e-4 + 2e-5 * std::abs(a[j]));
      for (int j = 0; j < 2; ++j) EXPECT_NEAR(ga[j], gb[j], 2e-4 + 2e-5 * std::abs(ga[j]));
      for (int j = 0; j < 5; ++j) {
        EXPECT_EQ(ia[j], ib[j]);
        EXPECT_NEAR(ta[j], tb[j], 2e-4 + 2e-5 * std::abs(ta[j]));
      }
    }
  }
}

// A head with a bias, a multiplier and a softcap: the GPU applies the
// transform after its GEMM (worker/cuda/lm_head_transform.cu) as the CPU
// does after its own; logits and records agree within the f32 rounding.
TEST(CudaHidden, TheHeadTransformMatchesTheCpuPath) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 3000, H = 256, M = 40;
  const LmHeadSlice slice = TransformedSlice(N, H, 19);
  auto gpu = cuda::CudaBackend::Create(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto gw = (*gpu)->LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(gw.ok()) << gw.status();
  CpuBackend cpu;
  auto cw = cpu.LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(cw.ok()) << cw.status();
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 0, Values::kNormal, 20);
  std::vector<float> lc(M * N), lg(M * N);
  ASSERT_TRUE(cpu.HiddenLogits(**cw, v1::BF16, hidden.bytes.data(), M, lc.data()).ok());
  ASSERT_TRUE((*gpu)->HiddenLogits(**gw, v1::BF16, hidden.bytes.data(), M, lg.data()).ok());
  int capped = 0;
  for (size_t i = 0; i < lc.size(); ++i) {
    ASSERT_NEAR(lc[i], lg[i], 1e-4 * (1 + std::abs(lc[i]))) << i;
    ASSERT_LE(std::abs(lg[i]), 30.0f) << i;
    capped += std::abs(lg[i]) > 20.0f;
  }
  EXPECT_GT(capped, 0);
  const StatsSpec spec = Spec(5, 0, true);
  const size_t words = kernels::PartialWords(spec);
  std::vector<uint32_t> rc(M * words), rg(M * words);
  ASSERT_TRUE(cpu.HiddenPartials(**cw, v1::BF16, hidden.bytes.data(), 0, hidden.block(0), spec, rc.data()).ok());
  ASSERT_TRUE((*gpu)->HiddenPartials(**gw, v1::BF16, hidden.bytes.data(), 0, hidden.block(0), spec, rg.data()).ok());
  for (int64_t r = 0; r < M; ++r) {
    float a[2], b[2], ta[5], tb[5];
    int64_t ia[5], ib[5];
    const uint32_t* pc = rc.data() + r * words;
    const uint32_t* pg = rg.data() + r * words;
    const bool has_target = hidden.targets[r] >= 0;
    kernels::CombinePartials(&pc, 1, spec, has_target, {&a[0], &a[1], ta, ia, nullptr});
    kernels::CombinePartials(&pg, 1, spec, has_target, {&b[0], &b[1], tb, ib, nullptr});
    for (int j = 0; j < 2; ++j) EXPECT_NEAR(a[j], b[j], 2e-4 + 2e-5 * std::abs(a[j]));
  }
}

/// A one-rank one-pass item over `hidden`'s rows (host memory).
HiddenItemRows OneRankItem(const Rows& hidden, int gather_k) {
  HiddenItemRows item;
  item.dtype = hidden.dtype;
  item.own = hidden.bytes.data();
  item.first = {0};
  item.count = {hidden.n};
  item.rows = hidden.block(gather_k);
  return item;
}

// One pass in passes of bounded memory (Options::pass_bytes): 16-row
// passes give every record the bits of a single pass, and HiddenPartials
// (the same path on one rank) those bits too.
TEST(CudaOnePass, PassesOfBoundedMemoryGiveTheBitsOfOnePass) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 3000, H = 256, M = 75;
  LmHeadSlice slice = RandomSlice(N, H, 31);
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 2, Values::kNormal, 32);
  const StatsSpec spec = Spec(5, 2, true);
  const size_t words = kernels::PartialWords(spec);
  std::vector<std::vector<uint32_t>> records;
  for (size_t pass_bytes : {size_t{1} << 30, size_t{16} * H * 2}) {
    cuda::CudaBackend::Options opts;
    opts.gemm_chunk_bytes = 16 * N * 4;
    opts.pass_bytes = pass_bytes;
    auto gpu = cuda::CudaBackend::Create(0, opts);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto w = (*gpu)->LoadLmHead(slice, LmHeadPrecision::kAuto);
    ASSERT_TRUE(w.ok()) << w.status();
    SelfCommunicator self;
    records.emplace_back(M * words);
    const absl::Status st = (*gpu)->HiddenItemPartials(**w, OneRankItem(hidden, 2), self, spec, records.back().data());
    ASSERT_TRUE(st.ok()) << st;
    if (records.size() == 1) {
      std::vector<uint32_t> rounds(M * words);
      ASSERT_TRUE(
          (*gpu)->HiddenPartials(**w, v1::BF16, hidden.bytes.data(), 0, hidden.block(2), spec, rounds.data()).ok());
      EXPECT_EQ(rounds, records.back());
    }
  }
  EXPECT_EQ(records[0], records[1]);
}

/// Rows [begin, end) of `slice` (an lm_head vocabulary slice of a slice).
LmHeadSlice SubSlice(const LmHeadSlice& slice, int64_t begin, int64_t end) {
  const size_t row = static_cast<size_t>(slice.hidden_size) * DTypeSize(slice.dtype);
  LmHeadSlice s = slice;
  s.rows = end - begin;
  s.weight = std::vector<char>(slice.weight.data() + begin * row, slice.weight.data() + end * row);
  return s;
}

/// Runs a W-rank one-pass item on W threads sharing device 0 over device
/// collectives staged through host memory (what two CUDA workers over Gloo
/// run; NCCL refuses two ranks on one GPU): rank r holds lm_head rows
/// SplitRange(N, W, r) and item rows SplitRows(M, W). `fail_gemm_after[r]`
/// is rank r's Options::fail_gemm_after. Returns each rank's status and
/// own records ([W][count[r]][words]).
std::vector<std::pair<absl::Status, std::vector<uint32_t>>> RunStagedRanks(
    int W, const LmHeadSlice& lm_head, const Rows& hidden, const StatsSpec& spec, int gather_k,
    const std::vector<int64_t>& fail_gemm_after) {
  const int64_t N = lm_head.rows, H = lm_head.hidden_size;
  const RankRows split = SplitRows(hidden.n, W);
  const size_t words = kernels::PartialWords(spec);
  testing::InProcessGroup group(W, std::chrono::seconds(120));
  std::vector<std::pair<absl::Status, std::vector<uint32_t>>> out(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      absl::Status& st = out[r].first;
      std::vector<uint32_t>& records = out[r].second;
      records.assign(static_cast<size_t>(W * split.count[r]) * words, 0);
      auto fail = [&](absl::Status why) {
        st = std::move(why);
        group.Abort();  // the others must not wait for this rank
      };
      cuda::CudaBackend::Options opts;
      opts.gemm_chunk_bytes = 16 * N * 4;
      opts.pass_bytes = 16 * H * 2;  // passes of 16 rows per rank
      opts.fail_gemm_after = fail_gemm_after[r];
      auto gpu = cuda::CudaBackend::Create(0, opts);
      if (!gpu.ok()) return fail(gpu.status());
      const auto [vb, ve] = SplitRange(N, W, r);
      auto w = (*gpu)->LoadLmHead(SubSlice(lm_head, vb, ve), LmHeadPrecision::kAuto);
      if (!w.ok()) return fail(w.status());
      auto copy = cuda::CudaDeviceCopy::Create(0);
      if (!copy.ok()) return fail(copy.status());
      HostStagedDeviceCollectives comm(std::make_unique<testing::InProcessCommunicator>(group, r), std::move(*copy));
      HiddenItemRows item;
      item.dtype = hidden.dtype;
      item.own = hidden.bytes.data() + split.first[r] * H * static_cast<int64_t>(DTypeSize(hidden.dtype));
      item.vocab_begin = vb;
      item.first = split.first;
      item.count = split.count;
      item.rows = hidden.block(gather_k);
      st = (*gpu)->HiddenItemPartials(**w, item, comm, spec, records.data());
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// A row's logits are the same bits wherever it sits among a GEMM's rows
// and whatever M, for odd and even slice widths: the GPU run of 2026-11-28
// saw the odd widths' kernel (logits rows not 16-byte aligned) give a moved
// row other bits; the GEMM now runs over a width rounded up to
// kLogitsAlign.
TEST(CudaGemm, ARowsBitsDoNotDependOnWhereItSitsAmongTheRows) {
  SKIP_WITHOUT_GPU();
  const int64_t H = 256, M = 75;
  for (const int64_t N : {1001, 1501, 1500, 3000}) {
    for (const LmHeadPrecision precision : {LmHeadPrecision::kBf16, LmHeadPrecision::kFp32}) {
      SCOPED_TRACE(absl::StrCat("N = ", N, ", ", LmHeadPrecisionName(precision)));
      const LmHeadSlice head = RandomSlice(N, H, 51);
      auto gemm = cuda::CublasLtLmHead::Create(head.dtype, head.weight.data(), head.weight.size(), N, H, precision,
                                               /*algo_rows=*/32);
      ASSERT_TRUE(gemm.ok()) << gemm.status();
      const int64_t S = (*gemm)->logits_stride();
      EXPECT_EQ(S % cuda::CublasLtLmHead::kLogitsAlign, 0);
      EXPECT_GE(S, N);
      const DType dtype = (*gemm)->compute_dtype();
      const Rows hidden = MakeRows(dtype, M, H, 0, N, 0, Values::kNormal, 52);
      const size_t row = static_cast<size_t>(H) * DTypeSize(dtype);
      cuda::DeviceBuffer dev_hidden, dev_logits;
      ASSERT_TRUE(dev_hidden.Reserve(hidden.bytes.size()).ok());
      ASSERT_TRUE(dev_logits.Reserve(static_cast<size_t>(M * S) * 4).ok());
      ASSERT_TRUE(cuda::UploadAndWait(dev_hidden.get(), hidden.bytes.data(), hidden.bytes.size()).ok());
      // logits of rows [r0, r0 + n), as one GEMM of n rows.
      auto logits = [&](int64_t r0, int64_t n) {
        std::vector<float> out(static_cast<size_t>(n * S));
        EXPECT_TRUE((*gemm)->Compute(dev_hidden.get<char>() + r0 * row, n, dev_logits.get<float>(), nullptr).ok());
        EXPECT_EQ(cudaMemcpy(out.data(), dev_logits.get(), out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        return out;
      };
      const std::vector<float> all = logits(0, M);
      for (const auto& [r0, n] :
           std::vector<std::pair<int64_t, int64_t>>{{38, 16}, {7, 5}, {25, 16}, {1, 31}, {74, 1}}) {
        const std::vector<float> part = logits(r0, n);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(std::memcmp(part.data() + i * S, all.data() + (r0 + i) * S, static_cast<size_t>(N) * 4), 0)
              << "row " << r0 + i << " in a GEMM of " << n << " rows from row " << r0;
      }
    }
  }
}

// Two ranks on one GPU over staged device collectives (the Gloo path of
// CUDA workers): each rank's records of every slice are the bits of that
// slice's one-rank item (same GEMM algorithm and kernels whatever M and
// position), for W = 2 and 3 with uneven shares and several passes.
TEST(CudaOnePass, RanksSharingOneGpuOverStagedCollectivesGiveTheBitsOfOneRank) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 3001, H = 256, M = 75;
  const LmHeadSlice lm_head = RandomSlice(N, H, 41);
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 2, Values::kNormal, 42);
  const StatsSpec spec = Spec(5, 2, true);
  const size_t words = kernels::PartialWords(spec);
  for (int W : {2, 3}) {
    SCOPED_TRACE(W);
    const auto ranks = RunStagedRanks(W, lm_head, hidden, spec, 2, std::vector<int64_t>(W, -1));
    const RankRows split = SplitRows(M, W);
    for (int q = 0; q < W; ++q) {
      // Slice q alone on one rank: all M rows.
      cuda::CudaBackend::Options opts;
      opts.gemm_chunk_bytes = 16 * N * 4;
      auto gpu = cuda::CudaBackend::Create(0, opts);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      const auto [vb, ve] = SplitRange(N, W, q);
      auto w = (*gpu)->LoadLmHead(SubSlice(lm_head, vb, ve), LmHeadPrecision::kAuto);
      ASSERT_TRUE(w.ok()) << w.status();
      std::vector<uint32_t> alone(M * words);
      ASSERT_TRUE(
          (*gpu)->HiddenPartials(**w, v1::BF16, hidden.bytes.data(), vb, hidden.block(2), spec, alone.data()).ok());
      for (int r = 0; r < W; ++r) {
        ASSERT_TRUE(ranks[r].first.ok()) << "rank " << r << ": " << ranks[r].first;
        // Every row is compared; a mismatch says how many rows differ, the
        // first one's words (as floats), and which reference row (if any)
        // it equals instead, so one GPU run tells a shift from rounding.
        std::vector<int64_t> differing;
        for (int64_t i = 0; i < split.count[r]; ++i) {
          const uint32_t* got = ranks[r].second.data() + RecordIndex(q, i, split.count[r], words);
          const uint32_t* want = alone.data() + (split.first[r] + i) * words;
          if (!std::equal(got, got + words, want)) differing.push_back(i);
        }
        if (differing.empty()) continue;
        const int64_t i = differing.front();
        const uint32_t* got = ranks[r].second.data() + RecordIndex(q, i, split.count[r], words);
        const uint32_t* want = alone.data() + (split.first[r] + i) * words;
        std::string words_text;
        for (size_t k = 0; k < std::min<size_t>(words, 8); ++k) {
          float g, x;
          std::memcpy(&g, got + k, 4);
          std::memcpy(&x, want + k, 4);
          words_text += " [" + std::to_string(k) + "] " + std::to_string(g) + " vs " + std::to_string(x);
        }
        int64_t equals_row = -1;
        for (int64_t j = 0; j < M && equals_row < 0; ++j)
          if (std::equal(got, got + words, alone.data() + j * words)) equals_row = j;
        ADD_FAILURE() << "rank " << r << " slice " << q << ": " << differing.size() << " of " << split.count[r]
                      << " rows differ, first row " << i << " (item row " << split.first[r] + i
                      << "), words got vs want:" << words_text << "; equals reference row " << equals_row;
      }
    }
  }
}

// A GEMM failing on one rank of two sharing a GPU over staged collectives:
// that rank returns the injected error, its peer RESOURCE_EXHAUSTED naming
// it (the agreement before the record exchange), neither waits for the
// collective timeout.
TEST(CudaOnePass, AFailingRankOverStagedCollectivesFailsItsPeerToo) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 2000, H = 128, M = 64;
  const LmHeadSlice lm_head = RandomSlice(N, H, 43);
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 0, Values::kNormal, 44);
  const auto ranks = RunStagedRanks(2, lm_head, hidden, Spec(0, 0, false), 0, {-1, 1});
  EXPECT_EQ(ranks[1].first.code(), absl::StatusCode::kInternal) << ranks[1].first;
  EXPECT_NE(std::string(ranks[1].first.message()).find("injected"), std::string::npos) << ranks[1].first;
  EXPECT_EQ(ranks[0].first.code(), absl::StatusCode::kResourceExhausted) << ranks[0].first;
  EXPECT_NE(std::string(ranks[0].first.message()).find("rank 1"), std::string::npos) << ranks[0].first;
}

// An item cancelled between passes returns CANCELLED; the backend scores
// the next item.
TEST(CudaOnePass, StopsBetweenPasses) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 1000, H = 128, M = 64;
  cuda::CudaBackend::Options opts;
  opts.pass_bytes = 16 * H * 2;  // passes of 16 rows
  auto gpu = cuda::CudaBackend::Create(0, opts);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto w = (*gpu)->LoadLmHead(RandomSlice(N, H, 33), LmHeadPrecision::kAuto);
  ASSERT_TRUE(w.ok()) << w.status();
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 0, Values::kNormal, 34);
  const StatsSpec spec = Spec(0, 0, false);
  std::vector<uint32_t> out(M * kernels::PartialWords(spec));
  SelfCommunicator self;
  HiddenItemRows item = OneRankItem(hidden, 0);
  int polls = 0;
  item.should_stop = [&polls] { return ++polls > 2; };
  EXPECT_EQ((*gpu)->HiddenItemPartials(**w, item, self, spec, out.data()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(polls, 3);  // the agreement before pass 0, then passes 1 and 2
  item.should_stop = nullptr;
  EXPECT_TRUE((*gpu)->HiddenItemPartials(**w, item, self, spec, out.data()).ok());
}

// Fix of the review (issue 2): a GEMM that fails after chunks were queued
// (Options::fail_gemm_after, the LOGPROB_TEST_FAIL_GEMM_AFTER hook) leaves
// nothing running; a logits item running concurrently and the next hidden
// item give the CPU kernel's records.
TEST(CudaOnePass, InjectedGemmFailureThenConcurrentLogitsItemAndNextItemScore) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 3000, H = 256, M = 80;
  LmHeadSlice slice = RandomSlice(N, H, 35);
  cuda::CudaBackend::Options opts;
  opts.gemm_chunk_bytes = 16 * N * 4;  // 5 chunks
  opts.fail_gemm_after = 2;
  auto gpu = cuda::CudaBackend::Create(0, opts);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto gw = (*gpu)->LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(gw.ok()) << gw.status();
  CpuBackend cpu;
  auto cw = cpu.LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(cw.ok()) << cw.status();
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 0, Values::kNormal, 36);
  const Rows logits = MakeRows(v1::BF16, 300, 5000, 0, 5000, 2, Values::kNormal, 37);
  const StatsSpec spec = Spec(5, 0, true), lspec = Spec(5, 2, true);
  const size_t words = kernels::PartialWords(spec), lwords = kernels::PartialWords(lspec);
  SelfCommunicator self;
  std::vector<uint32_t> failed(M * words);
  const absl::Status st = (*gpu)->HiddenItemPartials(**gw, OneRankItem(hidden, 0), self, spec, failed.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(std::string(st.message()).find("injected"), std::string::npos) << st;
  // A logits item concurrently with the next hidden item.
  std::vector<uint32_t> lcpu(300 * lwords), lgpu(300 * lwords);
  ASSERT_TRUE(cpu.SlicePartials(logits.logits(), logits.block(2), lspec, lcpu.data()).ok());
  absl::Status logits_st;
  std::thread t([&] { logits_st = (*gpu)->SlicePartials(logits.logits(), logits.block(2), lspec, lgpu.data()); });
  std::vector<uint32_t> again(M * words), rounds(M * words);
  const absl::Status st2 = (*gpu)->HiddenItemPartials(**gw, OneRankItem(hidden, 0), self, spec, again.data());
  t.join();
  ASSERT_TRUE(st2.ok()) << st2;
  ASSERT_TRUE(logits_st.ok()) << logits_st;
  ExpectRecordsMatch(lcpu, lgpu, 300, lspec);
  ASSERT_TRUE(
      (*gpu)->HiddenPartials(**gw, v1::BF16, hidden.bytes.data(), 0, hidden.block(0), spec, rounds.data()).ok());
  EXPECT_EQ(again, rounds);  // same GEMM algorithm and kernels: the same bits
  std::vector<uint32_t> rc(M * words);
  ASSERT_TRUE(cpu.HiddenPartials(**cw, v1::BF16, hidden.bytes.data(), 0, hidden.block(0), spec, rc.data()).ok());
  for (int64_t r = 0; r < M; ++r) {
    const uint32_t* pc = rc.data() + r * words;
    const uint32_t* pg = again.data() + r * words;
    float a[2], b[2], ta[5], tb[5];
    int64_t ia[5], ib[5];
    kernels::CombinePartials(&pc, 1, spec, hidden.targets[r] >= 0, {&a[0], &a[1], ta, ia, nullptr});
    kernels::CombinePartials(&pg, 1, spec, hidden.targets[r] >= 0, {&b[0], &b[1], tb, ib, nullptr});
    for (int j = 0; j < 2; ++j) EXPECT_NEAR(a[j], b[j], 2e-4 + 2e-5 * std::abs(a[j])) << "row " << r;
  }
}

// Fix of the review (issue 6): a range is page-locked only when every byte
// is: a registered range followed by a pageable gap is not.
TEST(CudaPinned, IsPageLockedChecksTheWholeRange) {
  SKIP_WITHOUT_GPU();
  auto gpu = cuda::CudaBackend::Create(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 1 << 20), cudaSuccess);
  const char* p = static_cast<const char*>(pinned);
  EXPECT_TRUE((*gpu)->IsPageLocked(p, 1 << 20));
  EXPECT_TRUE((*gpu)->IsPageLocked(p + 100, 1000));
  EXPECT_FALSE((*gpu)->IsPageLocked(p, 0));
  cudaFreeHost(pinned);
  // Three pages-aligned parts; the first and the third registered.
  const size_t part = size_t{1} << 21;
  void* mem = nullptr;
  ASSERT_EQ(posix_memalign(&mem, 4096, 3 * part), 0);
  std::memset(mem, 1, 3 * part);
  char* m = static_cast<char*>(mem);
  (*gpu)->RegisterHostMemory(m, part);
  (*gpu)->RegisterHostMemory(m + 2 * part, part);
  int read_only = 0;
  cudaDeviceGetAttribute(&read_only, cudaDevAttrHostRegisterReadOnlySupported, 0);
  EXPECT_EQ((*gpu)->IsPageLocked(m, part), read_only != 0);
  EXPECT_EQ((*gpu)->IsPageLocked(m + 2 * part + 5, 100), read_only != 0);
  EXPECT_FALSE((*gpu)->IsPageLocked(m, 3 * part));         // the pageable gap
  EXPECT_FALSE((*gpu)->IsPageLocked(m + part - 10, 20));   // ends in the gap
  EXPECT_FALSE((*gpu)->IsPageLocked(m + part + 7, part));  // starts in the gap
  (*gpu)->UnregisterHostMemory(m);
  (*gpu)->UnregisterHostMemory(m + 2 * part);
  EXPECT_FALSE((*gpu)->IsPageLocked(m, part));
  std::free(mem);
}

// Batch invariance (docs/SPEC.md): one row's logits are the same bits
// whatever M its GEMM has and wherever the row sits, in every precision
// (the cuBLASLt algorithm is chosen once, split-K 1, for every M).
TEST(CudaHidden, GemmRowIsBitwiseIndependentOfMAndPosition) {
  SKIP_WITHOUT_GPU();
  // Every (M, pos) below reads rows [anchor - pos, anchor - pos + M) of
  // `hidden`: anchor >= max pos = kMaxM - 1 and anchor + kMaxM <= kRows.
  const std::vector<int64_t> kMs = {1, 2, 3, 17, 64, 129, 257};
  const int64_t kMaxM = *std::max_element(kMs.begin(), kMs.end());
  const int64_t N = 3000, H = 512, anchor = kMaxM - 1, kRows = anchor + kMaxM;
  const Rows hidden = MakeRows(v1::F32, kRows, H, 0, N, 0, Values::kNormal, 21);
  for (LmHeadPrecision p : {LmHeadPrecision::kBf16, LmHeadPrecision::kTf32, LmHeadPrecision::kFp32}) {
    SCOPED_TRACE(LmHeadPrecisionName(p));
    LmHeadSlice slice = RandomSlice(N, H, 22);
    cuda::CudaBackend::Options opts;
    opts.gemm_chunk_bytes = 1024 * N * 4;  // every M below, and kRows, is one GEMM
    auto gpu = cuda::CudaBackend::Create(0, opts);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto w = (*gpu)->LoadLmHead(slice, p);
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<float> all(kRows * N);
    ASSERT_TRUE((*gpu)->HiddenLogits(**w, v1::F32, hidden.bytes.data(), kRows, all.data()).ok());
    for (int64_t M : kMs) {
      for (int64_t pos : {int64_t{0}, M / 2, M - 1}) {
        const int64_t first = anchor - pos;
        ASSERT_TRUE(first >= 0 && first + M <= kRows) << "M = " << M << ", pos = " << pos;
        std::vector<float> out(M * N);
        ASSERT_TRUE((*gpu)->HiddenLogits(**w, v1::F32, hidden.bytes.data() + first * H * 4, M, out.data()).ok());
        ASSERT_EQ(std::memcmp(out.data() + pos * N, all.data() + anchor * N, N * 4), 0)
            << "row " << anchor << " at position " << pos << " of M = " << M << " differs from M = " << kRows;
      }
    }
  }
}

// Issue 50: a tolerance that tells tf32 from bf16. The per-element bound
// |out - ref| <= rel * sum |products| cannot: rounding errors of random
// sign mostly cancel, so a bf16 GEMM passes a tf32 bound as well. The
// spread of the errors can: per output, (out - ref) / sqrt(sum products^2)
// is about the RMS relative rounding error of one hidden-state operand (the
// weights are bf16 here, exact in every precision), and its RMS over the
// outputs is ~2e-4 for tf32 rounded to nearest, ~4e-4 truncated (the tensor
// cores' rounding mode is theirs), ~1.6e-3 for bf16, ~3e-8 for exact
// operands (CudaHiddenTolerance prints them for the data below).
constexpr double kTf32MinSpread = 1e-4, kTf32MaxSpread = 8e-4;

/// The RMS over the outputs of (out - ref) / sqrt(sum_k (h w)^2), ref the
/// float64 GEMM of the exact operands h [M, H], w [N, H]; out [M, N].
double OperandSpread(const std::vector<float>& h, const std::vector<float>& w, const std::vector<float>& out, int64_t M,
                     int64_t N, int64_t H) {
  double sum = 0;
  int64_t count = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0, sq = 0;
      for (int64_t k = 0; k < H; ++k) {
        const double prod = static_cast<double>(h[m * H + k]) * w[n * H + k];
        ref += prod;
        sq += prod * prod;
      }
      if (sq == 0) continue;
      const double e = (out[m * N + n] - ref) / std::sqrt(sq);
      sum += e * e;
      ++count;
    }
  return count ? std::sqrt(sum / static_cast<double>(count)) : 0.0;
}

/// float(sum_k round(h[m, k]) * w[n, k]) in float64: a GEMM whose hidden
/// operands are rounded by `round`, accumulated exactly.
std::vector<float> RoundedGemm(const std::vector<float>& h, const std::vector<float>& w, int64_t M, int64_t N,
                               int64_t H, float (*round)(float)) {
  std::vector<float> out(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += static_cast<double>(round(h[m * H + k])) * w[n * H + k];
      out[m * N + n] = static_cast<float>(acc);
    }
  return out;
}

float TruncateToTf32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u &= ~0x1fffu;
  std::memcpy(&f, &u, 4);
  return f;
}
float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }
float Exact(float f) { return f; }

/// The shapes and values of the precision tests: F32 hidden states, BF16 weights.
constexpr int64_t kPrecN = 1000, kPrecH = 256, kPrecM = 40;
std::vector<float> SliceValues(const LmHeadSlice& slice) {
  std::vector<float> w(slice.rows * slice.hidden_size);
  ToFloat(v1::BF16, slice.weight.data(), w.size(), w.data());
  return w;
}

// Runs everywhere: the spread bounds tell tf32 (either rounding) from bf16
// and from exact operands on the values the GPU test below multiplies.
TEST(CudaHiddenTolerance, TheSpreadTellsTf32FromBf16AndFromExactOperands) {
  const Rows hidden = MakeRows(v1::F32, kPrecM, kPrecH, 0, kPrecN, 0, Values::kNormal, 31);
  const std::vector<float> w = SliceValues(RandomSlice(kPrecN, kPrecH, 32));
  const auto spread = [&](float (*round)(float)) {
    return OperandSpread(hidden.values, w, RoundedGemm(hidden.values, w, kPrecM, kPrecN, kPrecH, round), kPrecM, kPrecN,
                         kPrecH);
  };
  const double nearest = spread(RoundToTf32), truncated = spread(TruncateToTf32), bf16 = spread(RoundToBf16),
               exact = spread(Exact);
  EXPECT_GT(nearest, kTf32MinSpread);
  EXPECT_LT(nearest, kTf32MaxSpread);
  EXPECT_GT(truncated, kTf32MinSpread);
  EXPECT_LT(truncated, kTf32MaxSpread);
  EXPECT_GT(bf16, kTf32MaxSpread) << "a bf16 GEMM would pass as tf32";
  EXPECT_LT(exact, kTf32MinSpread / 100);
  std::printf("operand spread: tf32 nearest %.3g, truncated %.3g, bf16 %.3g, exact %.3g\n", nearest, truncated, bf16,
              exact);
}

// fp32, tf32 and bf16 on BF16 weights and F32 hidden states against
// float64: fp32 within f32 accumulation of the exact operands; tf32 within
// the rounding of tf32 operands per element (truncation's 2^-10 at worst)
// and a spread of tf32, not bf16 (above); bf16 (the positive control: the
// same data through bf16 operands) a spread above tf32's.
TEST(CudaHidden, Fp32Tf32AndBf16PrecisionsMatchFloat64) {
  SKIP_WITHOUT_GPU();
  const int64_t N = kPrecN, H = kPrecH, M = kPrecM;
  const Rows hidden = MakeRows(v1::F32, M, H, 0, N, 0, Values::kNormal, 31);
  for (LmHeadPrecision p : {LmHeadPrecision::kFp32, LmHeadPrecision::kTf32, LmHeadPrecision::kBf16}) {
    SCOPED_TRACE(LmHeadPrecisionName(p));
    LmHeadSlice slice = RandomSlice(N, H, 32);
    const std::vector<float> w = SliceValues(slice);
    auto gpu = cuda::CudaBackend::Create(0);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto lw = (*gpu)->LoadLmHead(slice, p);
    ASSERT_TRUE(lw.ok()) << lw.status();
    std::vector<float> out(M * N);
    ASSERT_TRUE((*gpu)->HiddenLogits(**lw, v1::F32, hidden.bytes.data(), M, out.data()).ok());
    const double spread = OperandSpread(hidden.values, w, out, M, N, H);
    std::printf("%s: operand spread %.3g\n", LmHeadPrecisionName(p), spread);
    if (p == LmHeadPrecision::kBf16) {
      EXPECT_GT(spread, kTf32MaxSpread);
      continue;
    }
    if (p == LmHeadPrecision::kTf32) {
      EXPECT_GT(spread, kTf32MinSpread) << "no tf32 rounding seen: fp32?";
      EXPECT_LT(spread, kTf32MaxSpread) << "rounding as coarse as bf16's";
    } else {
      EXPECT_LT(spread, kTf32MinSpread / 10);
    }
    const double rel = p == LmHeadPrecision::kFp32 ? 1e-5 : 1.1e-3;  // tf32: 2^-10 + accumulation
    int bad = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < H; ++k) {
          const double prod = static_cast<double>(hidden.values[m * H + k]) * w[n * H + k];
          ref += prod;
          mag += std::fabs(prod);
        }
        if (!(std::fabs(out[m * N + n] - ref) <= rel * mag + 1e-6) && ++bad <= 5)
          ADD_FAILURE() << "logits[" << m << ", " << n << "] = " << out[m * N + n] << ", want " << ref;
      }
    EXPECT_EQ(bad, 0);
  }
}

// Issue 50: errors other calls left on the thread (a failed allocation, a
// cudaHostUnregister of memory nobody registered) before the GEMMs of a
// head with a bias, a multiplier and a softcap: the transform's launch
// reported them as its own failure. The calls score the same bits as
// without them, and the backend's own handled errors leave nothing behind.
TEST(CudaHidden, AStaleErrorBeforeATransformedGemmIsNotItsFailure) {
  SKIP_WITHOUT_GPU();
  const int64_t N = 3000, H = 256, M = 40;
  const LmHeadSlice slice = TransformedSlice(N, H, 19);
  auto gpu = cuda::CudaBackend::Create(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto gw = (*gpu)->LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(gw.ok()) << gw.status();
  const Rows hidden = MakeRows(v1::BF16, M, H, 0, N, 0, Values::kNormal, 20);
  const StatsSpec spec = Spec(5, 0, true);
  const size_t words = kernels::PartialWords(spec);
  std::vector<float> want(M * N), got(M * N);
  std::vector<uint32_t> want_rec(M * words), got_rec(M * words);
  ASSERT_TRUE((*gpu)->HiddenLogits(**gw, v1::BF16, hidden.bytes.data(), M, want.data()).ok());
  ASSERT_TRUE(
      (*gpu)->HiddenPartials(**gw, v1::BF16, hidden.bytes.data(), 0, hidden.block(0), spec, want_rec.data()).ok());
  int host = 0;
  const std::vector<std::function<void()>> stale = {
      [] {
        void* p = nullptr;
        EXPECT_EQ(cudaMalloc(&p, size_t{1} << 60), cudaErrorMemoryAllocation);
      },
      [&host] { EXPECT_EQ(cudaHostUnregister(&host), cudaErrorHostMemoryNotRegistered); },
  };
  for (const auto& leave : stale) {
    leave();
    ASSERT_NE(cudaPeekAtLastError(), cudaSuccess) << "no stale error injected";
    const absl::Status st = (*gpu)->HiddenLogits(**gw, v1::BF16, hidden.bytes.data(), M, got.data());
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0);
    leave();
    const absl::Status rec =
        (*gpu)->HiddenPartials(**gw, v1::BF16, hidden.bytes.data(), 0, hidden.block(0), spec, got_rec.data());
    ASSERT_TRUE(rec.ok()) << rec;
    EXPECT_EQ(got_rec, want_rec);
  }
  cudaGetLastError();
  // The backend's handled errors are not left for the next launch.
  (*gpu)->UnregisterHostMemory(&host);  // never registered: nothing to do
  EXPECT_GT((*gpu)->device_memory_bytes(), 0);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  EXPECT_FALSE((*gpu)->device_lost());
}

// NaN logits in top-k (issue 50): the GPU's records rank NaN as the CPU's
// do (above every number, then by id) and write every top-k slot, also
// after a request whose slots held other values (the scratch is reused).
TEST(CudaRecords, NanLogitsRankAsOnTheCpuInEveryTopkSlot) {
  SKIP_WITHOUT_GPU();
  const StatsSpec spec = Spec(8, 0, false);
  Backends b = Make();
  ASSERT_TRUE(b.gpu);
  const size_t words = kernels::PartialWords(spec);
  const Rows before = MakeRows(v1::F32, 4, 5000, 0, 5000, 0, Values::kNormal, 41);
  std::vector<uint32_t> earlier(before.n * words);
  ASSERT_TRUE(b.gpu->SlicePartials(before.logits(), before.block(0), spec, earlier.data()).ok());
  Rows rows = MakeRows(v1::F32, 4, 5000, 0, 5000, 0, Values::kNormal, 42);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<int64_t, float>> nans = {{7, nan}, {4100, -nan}, {2500, nan}, {3 * 5000 + 9, nan}};
  for (const auto& [at, v] : nans) {
    std::memcpy(rows.bytes.data() + at * 4, &v, 4);
    rows.values[at] = v;
  }
  for (int64_t i = 0; i < 5000; ++i) {  // row 2: every value NaN
    std::memcpy(rows.bytes.data() + (2 * 5000 + i) * 4, &nan, 4);
    rows.values[2 * 5000 + i] = nan;
  }
  std::vector<uint32_t> cpu(rows.n * words), gpu(rows.n * words, 0xdeadbeefu);
  ASSERT_TRUE(b.cpu->SlicePartials(rows.logits(), rows.block(0), spec, cpu.data()).ok());
  ASSERT_TRUE(b.gpu->SlicePartials(rows.logits(), rows.block(0), spec, gpu.data()).ok());
  for (int64_t r = 0; r < rows.n; ++r)
    for (int j = 0; j < spec.topk; ++j) {
      const int64_t w = r * words + record::TopkIdWord(0, spec.topk, j);
      EXPECT_EQ(gpu[w], cpu[w]) << "row " << r << ", top-k slot " << j;
    }
  EXPECT_EQ(static_cast<int32_t>(cpu[0 * words + record::TopkIdWord(0, spec.topk, 0)]), 7);
  EXPECT_EQ(static_cast<int32_t>(cpu[2 * words + record::TopkIdWord(0, spec.topk, 7)]), 7);  // all NaN: ids 0..7
}

TEST(CudaHidden, ABadLmHeadSliceIsInvalidArgument) {
  SKIP_WITHOUT_GPU();
  Backends b = Make();
  ASSERT_TRUE(b.gpu);
  LmHeadSlice bad{v1::BF16, std::vector<char>(10), 3, 4};  // 10 bytes, not 3 x 4 bf16
  EXPECT_EQ(b.gpu->LoadLmHead(bad, LmHeadPrecision::kAuto).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaDevice, NoDeviceIsAClearError) {
  // Runs everywhere: with a GPU the count is positive, without one the
  // error says so (what `--backend cuda` prints on such a machine).
  auto n = cuda::DeviceCount();
  if (n.ok()) {
    EXPECT_GT(*n, 0);
  } else {
    EXPECT_EQ(n.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(n.status().message().find("CUDA device"), std::string::npos) << n.status();
  }
}

TEST(CudaIpcOpen, BadArgumentsAndUnopenableHandlesAreClearErrors) {
  // Runs everywhere: argument checks come first; a 64-byte handle that is
  // no export of a live allocation cannot be opened (no GPU: the device
  // cannot be selected), FAILED_PRECONDITION either way.
  auto r = cuda::OpenCudaIpc(0, std::string(63, 'x'), 0, 16);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("the handle is 63 bytes; a cudaIpcMemHandle_t is 64"), std::string::npos)
      << r.status();
  r = cuda::OpenCudaIpc(0, std::string(64, 'x'), -2, 16);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  r = cuda::OpenCudaIpc(0, std::string(64, 'x'), 0, 16);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("CUDA IPC input: "), std::string::npos) << r.status();
  if (cuda::DeviceCount().ok()) {
    // The failed open left no error behind for later CUDA calls.
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

// The copy behind Worker.StageLmHeadRows on a GPU: device memory (what a
// mapped CUDA IPC allocation is) through the backend's DeviceCopy into a
// file at an offset, in several chunks and a tail, every byte as it was;
// a CPU backend has no DeviceCopy (runs everywhere).
TEST(CudaStageRows, DeviceBytesLandInTheFileAtTheOffset) {
  CpuBackend cpu(1);
  EXPECT_EQ(cpu.NewDeviceCopy().status().code(), absl::StatusCode::kFailedPrecondition);
  SKIP_WITHOUT_GPU();
  auto gpu = cuda::CudaBackend::Create(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto copy = (*gpu)->NewDeviceCopy();
  ASSERT_TRUE(copy.ok()) << copy.status();
  constexpr size_t kBytes = (size_t{3} << 20) + 12345, kOffset = 4096 + 24;
  std::string bytes(kBytes, '\0');
  std::mt19937 rng(11);
  for (char& c : bytes) c = static_cast<char>(rng());
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device, bytes.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  const std::string path = ::testing::TempDir() + "/cuda_stage_rows." + std::to_string(getpid());
  std::ofstream(path, std::ios::binary) << std::string(kOffset + kBytes + 8, '\xEE');
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::vector<char> buffer;
  const absl::Status st = CopyDeviceToFile(**copy, device, kBytes, fd, kOffset, &buffer, size_t{1} << 20);
  close(fd);
  cudaFree(device);
  ASSERT_TRUE(st.ok()) << st;
  std::ifstream in(path, std::ios::binary);
  const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  unlink(path.c_str());
  ASSERT_EQ(got.size(), kOffset + kBytes + 8);
  EXPECT_EQ(got.substr(0, kOffset), std::string(kOffset, '\xEE'));
  EXPECT_TRUE(got.compare(kOffset, kBytes, bytes) == 0);
  EXPECT_EQ(got.substr(kOffset + kBytes), std::string(8, '\xEE'));
}

}  // namespace
}  // namespace logprob
