// Kernel unit tests: ComputePartial + CombinePartials and SamplingKeepMin
// against a float64 reference computed here, whole-row and vocab-sliced.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "common/partition.h"
#include "worker/kernels/row_stats.h"
#include "worker/kernels/sampling_filter.h"
#include "worker/kernels/simd.h"

namespace logprob::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Ref {
  std::vector<double> logp;  // log_softmax over the kept set, -inf elsewhere
  double entropy = 0;
  double logZ = 0;  // log-normaliser of the kept x
};

/// float64 reference: x = z / T, NeMo-RL apply_top_k_top_p (ascending
/// sort, cumsum of softmax > 1 - p), log_softmax over the kept set.
Ref Reference(const std::vector<float>& z, float T, int top_k, float top_p) {
  const size_t V = z.size();
  std::vector<double> x(V);
  for (size_t i = 0; i < V; ++i) x[i] = static_cast<double>(static_cast<float>(z[i] / T));
  std::vector<size_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<bool> keep(V, true);
  if (top_k > 0 && static_cast<size_t>(top_k) < V) {
    const double kth = x[order[V - top_k]];
    for (size_t i = 0; i < V; ++i) keep[i] = x[i] >= kth;
  }
  if (top_p > 0 && top_p < 1) {
    double mx = -kInf, z0 = 0, c = 0;
    for (size_t i = 0; i < V; ++i)
      if (keep[i]) mx = std::max(mx, x[i]);
    for (size_t i = 0; i < V; ++i)
      if (keep[i]) z0 += std::exp(x[i] - mx);
    for (size_t j = 0; j < V; ++j) {
      const size_t i = order[j];
      if (!keep[i]) continue;
      c += std::exp(x[i] - mx) / z0;
      if (!(c > 1.0 - top_p) && j != V - 1) keep[i] = false;
    }
  }
  double mx = -kInf, s = 0;
  for (size_t i = 0; i < V; ++i)
    if (keep[i]) mx = std::max(mx, x[i]);
  for (size_t i = 0; i < V; ++i)
    if (keep[i]) s += std::exp(x[i] - mx);
  const double logZ = mx + std::log(s);
  Ref r;
  r.logZ = logZ;
  r.logp.resize(V);
  for (size_t i = 0; i < V; ++i) {
    r.logp[i] = keep[i] ? x[i] - logZ : -kInf;
    if (keep[i] && std::isfinite(x[i])) r.entropy -= std::exp(r.logp[i]) * r.logp[i];
  }
  return r;
}

void ExpectClose(double expected, float got, const std::string& what) {
  if (std::isinf(expected)) {
    EXPECT_EQ(expected, static_cast<double>(got)) << what;
    return;
  }
  EXPECT_NEAR(got, expected, 2e-4 + 2e-5 * std::abs(expected)) << what;
}

struct Outputs {
  float logprob = 0, entropy = 0, logsumexp = 0;
  std::vector<float> topk_lp, gathered;
  std::vector<int64_t> topk_id;
};

/// Scores one f32 row split into `slices` vocab slices (1 = whole row),
/// with filters applied through keep_min as the worker does.
Outputs Score(const std::vector<float>& z, int64_t target, const std::vector<int64_t>& gather, const StatsSpec& spec,
              int slices, int top_k = 0, float top_p = 1.f, const std::vector<int32_t>* keep = nullptr) {
  const int64_t V = static_cast<int64_t>(z.size());
  float keep_min = -std::numeric_limits<float>::infinity();
  if (top_k > 0 || top_p < 1.f) {
    std::vector<float> x(V), scratch;
    for (int64_t i = 0; i < V; ++i) x[i] = z[i] / spec.temperature;
    keep_min = SamplingKeepMin(x.data(), V, top_k, top_p, &scratch);
  }
  const size_t words = PartialWords(spec);
  std::vector<std::vector<uint32_t>> recs(slices, std::vector<uint32_t>(words));
  std::vector<float> scratch(kPartialScratchFloats);
  for (int r = 0; r < slices; ++r) {
    const auto [b, e] = SplitRange(V, slices, r);
    SliceRow row;
    row.logits = z.data() + b;
    row.target = target;
    row.gather_ids = gather.data();
    row.keep_min = keep_min;
    if (keep) {  // all ids: the kernel skips those outside its slice
      row.keep_ids = keep->data();
      row.keep_count = static_cast<int64_t>(keep->size());
    }
    ComputePartial(v1::F32, row, b, e - b, spec, recs[r].data(), scratch.data());
  }
  std::vector<const uint32_t*> ptrs;
  for (auto& r : recs) ptrs.push_back(r.data());
  Outputs o;
  o.topk_lp.resize(spec.topk);
  o.topk_id.resize(spec.topk);
  o.gathered.resize(spec.gather_k);
  RowOutput out;
  out.token_logprob = &o.logprob;
  out.entropy = &o.entropy;
  out.topk_logprobs = o.topk_lp.data();
  out.topk_indices = o.topk_id.data();
  out.gathered = o.gathered.data();
  out.logsumexp = &o.logsumexp;
  CombinePartials(ptrs.data(), slices, spec, target >= 0, out);
  return o;
}

/// Checks every output of Score against Reference.
void CheckRow(const std::vector<float>& z, int64_t target, const std::vector<int64_t>& gather, StatsSpec spec,
              int slices, int top_k = 0, float top_p = 1.f) {
  const Ref ref = Reference(z, spec.temperature, top_k, top_p);
  const Outputs o = Score(z, target, gather, spec, slices, top_k, top_p);
  const std::string ctx = "slices=" + std::to_string(slices);
  ExpectClose(target >= 0 ? ref.logp[target] : 0.0, o.logprob, ctx + " token_logprob");
  ExpectClose(ref.logZ, o.logsumexp, ctx + " logsumexp");
  if (spec.entropy) ExpectClose(ref.entropy, o.entropy, ctx + " entropy");
  for (int j = 0; j < spec.gather_k; ++j) ExpectClose(ref.logp[gather[j]], o.gathered[j], ctx + " gathered");
  std::vector<int64_t> ids(z.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return ref.logp[a] > ref.logp[b]; });
  for (int j = 0; j < spec.topk; ++j) {
    EXPECT_EQ(ids[j], o.topk_id[j]) << ctx << " topk id " << j;
    ExpectClose(ref.logp[ids[j]], o.topk_lp[j], ctx + " topk logprob");
  }
}

std::vector<float> RandomRow(int64_t V, uint32_t seed, float scale = 3.f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> z(V);
  for (auto& v : z) v = d(gen);
  return z;
}

TEST(RowStats, RandomRowsMatchFloat64AcrossSliceCounts) {
  StatsSpec spec;
  spec.entropy = true;
  spec.topk = 7;
  spec.gather_k = 3;
  for (int64_t V : {1000, 32000, 50257}) {
    const auto z = RandomRow(V, static_cast<uint32_t>(V));
    for (int slices : {1, 2, 3, 5}) CheckRow(z, V / 3, {0, V - 1, V / 2}, spec, slices);
  }
}

// Sampling masks (SliceRow::keep_ids): a row of several kBlock blocks cut
// into uneven slices, kept ids on both sides of block and slice edges; the
// combined outputs equal a float64 log-softmax over exactly the kept set.
TEST(RowStats, SamplingMaskAcrossBlocksAndSlices) {
  const int64_t V = 3 * static_cast<int64_t>(kBlock) + 123;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<float> z(static_cast<size_t>(V));
  for (auto& v : z) v = nd(rng);
  std::vector<int32_t> keep;
  for (int64_t id : {int64_t{0}, int64_t{5}, static_cast<int64_t>(kBlock) - 1, static_cast<int64_t>(kBlock),
                     static_cast<int64_t>(kBlock) + 17, 2 * static_cast<int64_t>(kBlock) + 1, V / 2, V - 2, V - 1})
    keep.push_back(static_cast<int32_t>(id));
  std::sort(keep.begin(), keep.end());
  keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
  StatsSpec spec;
  spec.entropy = true;
  spec.temperature = 0.8f;
  spec.topk = 3;
  spec.gather_k = 2;
  const std::vector<int64_t> gather = {keep[2], 1};  // one kept id, one removed
  // float64 over the set.
  double mx = -kInf, s = 0;
  for (int32_t id : keep) mx = std::max(mx, static_cast<double>(z[id] / spec.temperature));
  for (int32_t id : keep) s += std::exp(z[id] / spec.temperature - mx);
  const double logZ = mx + std::log(s);
  double entropy = 0;
  for (int32_t id : keep) {
    const double lp = z[id] / spec.temperature - logZ;
    entropy -= std::exp(lp) * lp;
  }
  for (int slices : {1, 2, 3, 5}) {
    for (int64_t target : {static_cast<int64_t>(keep[4]), int64_t{2}}) {  // in the set; outside it
      const Outputs o = Score(z, target, gather, spec, slices, 0, 1.f, &keep);
      const std::string ctx = "slices=" + std::to_string(slices) + " target=" + std::to_string(target);
      ExpectClose(target == keep[4] ? z[target] / spec.temperature - logZ : -kInf, o.logprob, ctx + " token_logprob");
      ExpectClose(entropy, o.entropy, ctx + " entropy");
      ExpectClose(z[gather[0]] / spec.temperature - logZ, o.gathered[0], ctx + " gathered kept");
      ExpectClose(-kInf, o.gathered[1], ctx + " gathered removed");
      std::vector<int32_t> by_lp = keep;
      std::stable_sort(by_lp.begin(), by_lp.end(), [&](int32_t a, int32_t b) { return z[a] > z[b]; });
      for (int j = 0; j < 3; ++j) EXPECT_EQ(o.topk_id[j], by_lp[j]) << ctx << " topk " << j;
    }
  }
}

TEST(RowStats, TemperatureApplied) {
  StatsSpec spec;
  spec.entropy = true;
  spec.temperature = 0.7f;
  spec.topk = 4;
  const auto z = RandomRow(2048, 7);
  CheckRow(z, 11, {}, spec, 1);
  CheckRow(z, 11, {}, spec, 3);
}

TEST(RowStats, AllEqualLogits) {
  StatsSpec spec;
  spec.entropy = true;
  spec.topk = 5;
  const std::vector<float> z(1000, 0.25f);
  const Outputs o = Score(z, 3, {}, spec, 3);
  EXPECT_NEAR(o.logprob, -std::log(1000.0), 1e-5);
  EXPECT_NEAR(o.entropy, std::log(1000.0), 1e-4);
  for (int j = 0; j < 5; ++j) EXPECT_EQ(o.topk_id[j], j);  // ties: lower id first
}

TEST(RowStats, OneHugeLogit) {
  StatsSpec spec;
  spec.entropy = true;
  auto z = RandomRow(4096, 3, 1.f);
  z[1234] = 1e4f;
  for (int slices : {1, 2, 3}) {
    const Outputs o = Score(z, 1234, {}, spec, slices);
    EXPECT_NEAR(o.logprob, 0.0, 1e-6);
    EXPECT_GE(o.entropy, 0.f);
    EXPECT_NEAR(o.entropy, 0.0, 1e-6);
    CheckRow(z, 5, {}, spec, slices);
  }
}

TEST(RowStats, NegativeInfinityLogitsGiveNoNaN) {
  StatsSpec spec;
  spec.entropy = true;
  spec.topk = 3;
  spec.gather_k = 1;
  auto z = RandomRow(3000, 9);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < 1600; ++i) z[i] = ninf;  // one slice of 2 is all -inf
  for (int slices : {1, 2, 3}) {
    const Outputs o = Score(z, 10, {20}, spec, slices);
    EXPECT_EQ(o.logprob, ninf);
    EXPECT_EQ(o.gathered[0], ninf);
    EXPECT_FALSE(std::isnan(o.entropy));
    CheckRow(z, 2000, {2999}, spec, slices);
  }
}

// Issue 50: NaN logits in top-k. NaN (either sign) ranks above every
// number, NaNs among themselves by lower id (torch.topk's order; the GPU's
// Key): every slot is written, the ids are the same on every slicing, and
// the numbers follow in their usual order.
TEST(RowStats, NanLogitsRankFirstByIdInEveryTopkSlot) {
  StatsSpec spec;
  spec.topk = 6;
  const int64_t V = 3000;
  auto z = RandomRow(V, 17);
  z[2500] = std::numeric_limits<float>::quiet_NaN();
  z[40] = -std::numeric_limits<float>::quiet_NaN();
  z[1700] = std::numeric_limits<float>::quiet_NaN();
  // The numbers' order without the NaNs.
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < V; ++i)
    if (!std::isnan(z[i])) ids.push_back(i);
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return z[a] > z[b]; });
  const std::vector<int64_t> want = {40, 1700, 2500, ids[0], ids[1], ids[2]};
  for (int slices : {1, 2, 3, 7}) {
    SCOPED_TRACE("slices=" + std::to_string(slices));
    const Outputs o = Score(z, 10, {}, spec, slices);
    EXPECT_EQ(o.topk_id, want);
    for (int j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(o.topk_lp[j])) << j;
  }
  // Each slice's record: best first, NaN ones first, nothing left unwritten.
  const size_t words = PartialWords(spec);
  std::vector<uint32_t> rec(words, 0xdeadbeefu);  // what a previous row left
  std::vector<float> scratch(kPartialScratchFloats);
  SliceRow row;
  row.logits = z.data();
  row.target = 10;
  ComputePartial(v1::F32, row, 0, V, spec, rec.data(), scratch.data());
  for (int j = 0; j < spec.topk; ++j)
    EXPECT_EQ(static_cast<int64_t>(rec[record::TopkIdWord(0, spec.topk, j)]), want[j]) << j;
}

// Every value NaN: the top-k are the lowest ids, none left unwritten.
TEST(RowStats, AllNanRowKeepsTheLowestIds) {
  StatsSpec spec;
  spec.topk = 4;
  const std::vector<float> z(50, std::numeric_limits<float>::quiet_NaN());
  for (int slices : {1, 3}) {
    const Outputs o = Score(z, 0, {}, spec, slices);
    EXPECT_EQ(o.topk_id, (std::vector<int64_t>{0, 1, 2, 3})) << slices;
  }
}

// NextAbove, the top-k scan's skip, stops at a NaN whatever the floor.
// The GEMM's vector widening is ToFloat bit for bit: every bf16 and f16
// bit pattern (zeros, subnormals, infinities, NaNs), at lengths and
// offsets that leave every tail size, and f32 copied.
TEST(Simd, WidenToFloatIsToFloatForEveryBitPattern) {
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), 0);
  for (DType dtype : {v1::BF16, v1::F16}) {
    for (size_t offset : {0, 1, 3})
      for (size_t n : {size_t{65536} - 3, size_t{0}, size_t{1}, size_t{7}, size_t{17}, size_t{33}}) {
        std::vector<float> want(n), got(n, 1.5f);
        ToFloat(dtype, all.data() + offset, n, want.data());
        WidenToFloat(dtype, all.data() + offset, n, got.data());
        if (n > 0) {
          EXPECT_EQ(std::memcmp(want.data(), got.data(), n * 4), 0) << DTypeName(dtype) << " n " << n;
        }
      }
  }
  const std::vector<float> f = {1.f, -0.f, std::numeric_limits<float>::infinity(), 3e-45f, 7.f};
  std::vector<float> got(f.size());
  WidenToFloat(v1::F32, f.data(), f.size(), got.data());
  EXPECT_EQ(std::memcmp(f.data(), got.data(), f.size() * 4), 0);
}

TEST(Simd, NextAboveStopsAtNan) {
  std::vector<float> x(37, 1.0f);
  x[29] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(NextAbove(x.data(), 0, x.size(), 2.0f), 29u);
  x[29] = -std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(NextAbove(x.data(), 0, x.size(), 2.0f), 29u);
  x[3] = 5.0f;
  EXPECT_EQ(NextAbove(x.data(), 0, x.size(), 2.0f), 3u);
  EXPECT_EQ(NextAbove(x.data(), 30, x.size(), 2.0f), x.size());
}

TEST(RowStats, TopKEqualsVocab) {
  StatsSpec spec;
  spec.topk = 64;
  const auto z = RandomRow(64, 5);
  for (int slices : {1, 3}) CheckRow(z, 0, {}, spec, slices);
}

TEST(RowStats, TargetsOnSliceBoundaries) {
  StatsSpec spec;
  spec.entropy = true;
  const int64_t V = 50257;
  const auto z = RandomRow(V, 11);
  for (int slices : {2, 3}) {
    for (int r = 0; r < slices; ++r) {
      const auto [b, e] = SplitRange(V, slices, r);
      CheckRow(z, b, {}, spec, slices);
      CheckRow(z, e - 1, {}, spec, slices);
    }
  }
}

TEST(RowStats, IgnoredTargetIsZero) {
  StatsSpec spec;
  const auto z = RandomRow(100, 1);
  EXPECT_EQ(Score(z, -1, {}, spec, 2).logprob, 0.f);
}

TEST(RowStats, Bf16AndF16RowsMatchTheirFloatValues) {
  StatsSpec spec;
  spec.entropy = true;
  spec.topk = 3;
  const auto z = RandomRow(5000, 13);
  for (DType dt : {v1::BF16, v1::F16}) {
    std::vector<uint16_t> h(z.size());
    std::vector<float> exact(z.size());
    for (size_t i = 0; i < z.size(); ++i) {
      h[i] = dt == v1::BF16 ? FloatToBf16(z[i]) : FloatToF16(z[i]);
      exact[i] = dt == v1::BF16 ? Bf16ToFloat(h[i]) : F16ToFloat(h[i]);
    }
    const Ref ref = Reference(exact, 1.f, 0, 1.f);
    std::vector<uint32_t> rec(PartialWords(spec));
    std::vector<float> scratch(kPartialScratchFloats);
    SliceRow row;
    row.logits = h.data();
    row.target = 42;
    ComputePartial(dt, row, 0, static_cast<int64_t>(h.size()), spec, rec.data(), scratch.data());
    float lp, ent, tl[3];
    int64_t ti[3];
    RowOutput out{&lp, &ent, tl, ti, nullptr};
    const uint32_t* p = rec.data();
    CombinePartials(&p, 1, spec, true, out);
    ExpectClose(ref.logp[42], lp, "logprob");
    ExpectClose(ref.entropy, ent, "entropy");
  }
}

TEST(SamplingFilter, TopKTopPMatchNemoSemantics) {
  StatsSpec spec;
  spec.entropy = true;
  spec.topk = 5;
  spec.temperature = 0.7f;
  const auto z = RandomRow(2048, 21);
  for (auto [k, p] : std::vector<std::pair<int, float>>{{50, 1.f}, {0, 0.9f}, {50, 0.9f}, {1, 1.f}, {0, 0.3f}}) {
    const Ref ref = Reference(z, spec.temperature, k, p);
    // Score a kept and (where there is one) a filtered-out target.
    int64_t kept = -1, dropped = -1;
    for (int64_t i = 0; i < 2048; ++i) {
      if (std::isfinite(ref.logp[i])) kept = i;
      else dropped = i;
    }
    CheckRow(z, kept, {}, spec, 1, k, p);
    if (dropped >= 0) CheckRow(z, dropped, {}, spec, 1, k, p);
  }
}

TEST(SamplingFilter, TopPThatKeepsOneToken) {
  auto z = RandomRow(1000, 4, 1.f);
  z[17] = 50.f;
  std::vector<float> scratch;
  EXPECT_EQ(SamplingKeepMin(z.data(), 1000, 0, 0.5f, &scratch), 50.f);
  StatsSpec spec;
  spec.entropy = true;
  const Outputs o = Score(z, 17, {}, spec, 1, 0, 0.5f);
  EXPECT_EQ(o.logprob, 0.f);
  EXPECT_EQ(o.entropy, 0.f);
}

TEST(SamplingFilter, TopKTiesAtThresholdAreKept) {
  std::vector<float> z = {1.f, 3.f, 2.f, 2.f, 0.f};
  std::vector<float> scratch;
  EXPECT_EQ(SamplingKeepMin(z.data(), 5, 2, 1.f, &scratch), 2.f);  // 3, 2, 2 survive
}

}  // namespace
}  // namespace logprob::kernels

namespace logprob::kernels {
namespace {

// ExpSums' exp (for arguments <= 0) against float64, including -inf and
// arguments below the underflow cut.
TEST(Simd, ExpSumsMatchFloat64) {
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> d(-100.f, 0.f);
  std::vector<float> x(kBlock + 64, -std::numeric_limits<float>::infinity());
  for (size_t i = 0; i < kBlock; ++i)
    x[i] = i % 97 == 0 ? -std::numeric_limits<float>::infinity() : d(gen) / (1 + i % 7);
  double s_ref = 0, u_ref = 0;
  for (size_t i = 0; i < kBlock; ++i) {
    const double e = std::exp(static_cast<double>(x[i]));
    s_ref += e;
    if (e > 0) u_ref += e * x[i];
  }
  float s = 0, u = 0;
  ExpSums(x.data(), kBlock, 0.f, &s, &u);
  EXPECT_NEAR(s, s_ref, 2e-6 * s_ref);
  EXPECT_NEAR(u, u_ref, 2e-6 * std::abs(u_ref));
  float s_only = 0;
  ExpSums(x.data(), kBlock, 0.f, &s_only, nullptr);
  EXPECT_EQ(s_only, s);
}

}  // namespace
}  // namespace logprob::kernels
