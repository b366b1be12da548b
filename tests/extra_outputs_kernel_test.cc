// Kernel unit tests of the per-token outputs log_sum_sq_probs, mean_logits
// and is_top1 (docs/SPEC.md, Outputs): ComputePartial + CombinePartials
// against a float64 reference computed here, on rows with ties (bf16),
// -inf entries, sampling filters and temperature, whole and split into
// 1..4 vocabulary slices combined in rank order (as vocab-parallel
// workers do). is_top1 must match exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/partition.h"
#include "worker/kernels/partial_record.h"
#include "worker/kernels/row_stats.h"
#include "worker/kernels/sampling_filter.h"

namespace logprob::kernels {
namespace {

constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

/// One row of logits in its dtype's bytes, and its float32 values.
struct Row {
  DType dtype = v1::F32;
  std::vector<char> bytes;
  std::vector<float> z;  // the exact element values
};

Row MakeRow(DType dtype, const std::vector<float>& values) {
  Row r;
  r.dtype = dtype;
  r.bytes.resize(values.size() * DTypeSize(dtype));
  r.z.resize(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == v1::F32) {
      std::memcpy(r.bytes.data() + 4 * i, &values[i], 4);
      r.z[i] = values[i];
    } else {
      const uint16_t h = dtype == v1::BF16 ? FloatToBf16(values[i]) : FloatToF16(values[i]);
      std::memcpy(r.bytes.data() + 2 * i, &h, 2);
      r.z[i] = dtype == v1::BF16 ? Bf16ToFloat(h) : F16ToFloat(h);
    }
  }
  return r;
}

/// The three outputs, float64 reference or kernel result.
struct Extra {
  double log_sum_sq = 0, mean = 0;
  int top1 = 0;
};

/// float64 reference of one row: x = z / T in float32 (SPEC), the kept set
/// x >= keep_min (the sampling filter's threshold, tested on its own in
/// kernels_test.cc), p = softmax over the kept set.
Extra Reference(const Row& row, float T, float keep_min, int64_t target) {
  Extra e;
  if (target < 0) return e;  // not scored: 0
  const size_t V = row.z.size();
  std::vector<double> x(V);
  for (size_t i = 0; i < V; ++i) x[i] = static_cast<double>(T != 1.0f ? row.z[i] / T : row.z[i]);
  double sum = 0, mx = -std::numeric_limits<double>::infinity();
  size_t argmax = 0;
  for (size_t i = 0; i < V; ++i) {
    sum += x[i];
    if (x[i] > x[argmax]) argmax = i;  // strict: the lowest id among equal maxima
  }
  for (size_t i = 0; i < V; ++i)
    if (x[i] >= keep_min) mx = std::max(mx, x[i]);
  double s = 0, s2 = 0;
  for (size_t i = 0; i < V; ++i)
    if (x[i] >= keep_min) s += std::exp(x[i] - mx);
  for (size_t i = 0; i < V; ++i)
    if (x[i] >= keep_min) {
      const double p = std::exp(x[i] - mx) / s;
      s2 += p * p;
    }
  e.log_sum_sq = std::log(s2);
  e.mean = sum / static_cast<double>(V);
  e.top1 = static_cast<size_t>(target) == argmax ? 1 : 0;
  return e;
}

/// The kernel's outputs of `row` split into `slices` slices (SplitRange),
/// combined in rank order. Also returns token_logprob and entropy so the
/// test can check that asking for the extras leaves them bitwise alone.
struct Got {
  float log_sum_sq = 0, mean = 0, logprob = 0, entropy = 0;
  int32_t top1 = -1;
};
Got Kernel(const Row& row, int64_t target, const StatsSpec& spec, float keep_min, int slices) {
  const int64_t V = static_cast<int64_t>(row.z.size());
  const size_t words = PartialWords(spec), esize = DTypeSize(row.dtype);
  std::vector<std::vector<uint32_t>> recs(slices, std::vector<uint32_t>(words, 0xdeadbeefu));
  std::vector<float> scratch(kPartialScratchFloats);
  for (int r = 0; r < slices; ++r) {
    const auto [b, e] = SplitRange(V, slices, r);
    SliceRow sr;
    sr.logits = row.bytes.data() + b * esize;
    sr.target = target;
    sr.keep_min = keep_min;
    ComputePartial(row.dtype, sr, b, e - b, spec, recs[r].data(), scratch.data());
    EXPECT_EQ(recs[r][record::kReservedWord], 0u);
  }
  std::vector<const uint32_t*> ptrs;
  for (auto& r : recs) ptrs.push_back(r.data());
  Got g;
  RowOutput out;
  out.token_logprob = &g.logprob;
  out.entropy = &g.entropy;
  out.log_sum_sq_probs = &g.log_sum_sq;
  out.mean_logits = &g.mean;
  out.is_top1 = &g.top1;
  CombinePartials(ptrs.data(), slices, spec, target >= 0, out);
  return g;
}

StatsSpec ExtraSpec(float T, int64_t V) {
  StatsSpec spec;
  spec.temperature = T;
  spec.entropy = true;
  spec.log_sum_sq_probs = true;
  spec.mean_logits = true;
  spec.is_top1 = true;
  spec.vocab_size = V;
  return spec;
}

bool Near(double expected, double got) {
  if (std::isinf(expected)) return expected == got;
  return std::abs(expected - got) <= 2e-4 + 2e-5 * std::abs(expected);
}

/// Checks the three outputs of `row` for `target` against the reference,
/// for 1..4 slices; the sliced results also agree with the whole row's
/// within float32 rounding (is_top1 exactly).
void CheckRow(const Row& row, int64_t target, float T, int top_k, float top_p, const std::string& what) {
  const int64_t V = static_cast<int64_t>(row.z.size());
  const StatsSpec spec = ExtraSpec(T, V);
  float keep_min = kNegInfF;
  if (top_k > 0 || top_p < 1.f) {
    std::vector<float> x(V), scratch;
    for (int64_t i = 0; i < V; ++i) x[i] = T != 1.0f ? row.z[i] / T : row.z[i];
    keep_min = SamplingKeepMin(x.data(), V, top_k, top_p, &scratch);
  }
  const Extra ref = Reference(row, T, keep_min, target);
  const Got whole = Kernel(row, target, spec, keep_min, 1);
  for (int slices = 1; slices <= 4; ++slices) {
    SCOPED_TRACE(what + " target=" + std::to_string(target) + " slices=" + std::to_string(slices));
    const Got g = Kernel(row, target, spec, keep_min, slices);
    EXPECT_TRUE(Near(ref.log_sum_sq, g.log_sum_sq)) << "log_sum_sq_probs: " << ref.log_sum_sq << " vs " << g.log_sum_sq;
    EXPECT_TRUE(Near(ref.mean, g.mean)) << "mean_logits: " << ref.mean << " vs " << g.mean;
    EXPECT_EQ(ref.top1, g.top1) << "is_top1";
    EXPECT_NEAR(g.log_sum_sq, whole.log_sum_sq, 4e-6 * (1.0 + std::abs(whole.log_sum_sq)));
    if (std::isinf(whole.mean)) {
      EXPECT_EQ(g.mean, whole.mean);
    } else {
      EXPECT_NEAR(g.mean, whole.mean, 4e-6 * (1.0 + std::abs(whole.mean)));
    }
    if (target < 0) {
      EXPECT_EQ(g.log_sum_sq, 0.0f);
      EXPECT_EQ(g.mean, 0.0f);
      EXPECT_EQ(g.top1, 0);
    }
  }
}

/// Values with many exact ties at the top: normal(0, 2) rounded to 1/4.
std::vector<float> TiedValues(int64_t V, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> v(V);
  for (auto& x : v) x = std::round(nd(rng) * 4.f) / 4.f;
  return v;
}

/// Targets that exercise is_top1: the lowest id of the max, every other id
/// that ties it (not top-1), ids around slice boundaries, a random id,
/// and none (-1).
std::vector<int64_t> InterestingTargets(const std::vector<float>& z, float T, std::mt19937& rng) {
  const int64_t V = static_cast<int64_t>(z.size());
  std::vector<float> x(V);
  for (int64_t i = 0; i < V; ++i) x[i] = T != 1.0f ? z[i] / T : z[i];
  const float mx = *std::max_element(x.begin(), x.end());
  std::vector<int64_t> t;
  for (int64_t i = 0; i < V && t.size() < 6; ++i)
    if (x[i] == mx) t.push_back(i);
  for (int w = 2; w <= 4; ++w)
    for (int r = 1; r < w; ++r) {
      const int64_t b = SplitRange(V, w, r).first;
      t.push_back(b - 1);
      t.push_back(b);
    }
  t.push_back(0);
  t.push_back(V - 1);
  t.push_back(std::uniform_int_distribution<int64_t>(0, V - 1)(rng));
  t.push_back(-1);
  std::sort(t.begin(), t.end());
  t.erase(std::unique(t.begin(), t.end()), t.end());
  return t;  // starts with -1: no target
}

TEST(KernelExtraOutputs, MatchFloat64WithTiesFiltersAndSlices) {
  std::mt19937 rng(7);
  for (DType dtype : {v1::F32, v1::BF16, v1::F16}) {
    for (int64_t V : {int64_t{7}, int64_t{1000}, int64_t{5003}}) {  // 5003: three SIMD blocks, uneven slices
      for (float T : {1.0f, 0.7f}) {
        for (int filter = 0; filter < 3; ++filter) {
          const int top_k = filter == 1 ? 50 : 0;
          const float top_p = filter == 2 ? 0.9f : 1.f;
          const Row row = MakeRow(dtype, TiedValues(V, rng));
          const std::string what = std::string(DTypeName(dtype)) + " V=" + std::to_string(V) +
                                   " T=" + std::to_string(T) + " filter=" + std::to_string(filter);
          int top1_seen = 0;
          for (int64_t target : InterestingTargets(row.z, T, rng)) {
            CheckRow(row, target, T, top_k, top_p, what);
            top1_seen += Reference(row, T, kNegInfF, target).top1;
          }
          EXPECT_EQ(top1_seen, 1) << what << ": the lowest id of the max is the one top-1 target";
        }
      }
    }
  }
}

/// Maxima tied across slice boundaries: only the lowest id is top-1, in
/// whichever slice it lies.
TEST(KernelExtraOutputs, TiesAcrossSlicesGoToTheLowestId) {
  const int64_t V = 1000;
  std::vector<float> v(V, 0.5f);
  for (int64_t i = 0; i < V; ++i) v[i] = static_cast<float>(i % 17) / 8.f;
  // 3.0 at ids in slices 1, 2 and 3 of a 4-way split (250 each), and at
  // the very last id.
  for (int64_t id : {300, 310, 600, 999}) v[id] = 3.0f;
  const Row row = MakeRow(v1::BF16, v);
  const StatsSpec spec = ExtraSpec(1.0f, V);
  for (int slices = 1; slices <= 4; ++slices) {
    for (int64_t t : {300, 310, 600, 999, 0, 299}) {
      SCOPED_TRACE("slices=" + std::to_string(slices) + " target=" + std::to_string(t));
      EXPECT_EQ(Kernel(row, t, spec, kNegInfF, slices).top1, t == 300 ? 1 : 0);
    }
  }
}

/// -inf logits: the mean is -inf, log_sum_sq_probs and is_top1 ignore them;
/// a target at -inf is not top-1.
TEST(KernelExtraOutputs, NegativeInfinityEntries) {
  std::mt19937 rng(11);
  const int64_t V = 3001;
  for (DType dtype : {v1::F32, v1::BF16}) {
    std::vector<float> v = TiedValues(V, rng);
    for (int64_t i = 0; i < V; i += 3) v[i] = kNegInfF;  // a third of the row, including id 0
    const Row row = MakeRow(dtype, v);
    for (int64_t target : InterestingTargets(row.z, 1.0f, rng)) CheckRow(row, target, 1.0f, 0, 1.f, "-inf");
    EXPECT_EQ(Kernel(row, 0, ExtraSpec(1.0f, V), kNegInfF, 3).top1, 0);
    EXPECT_EQ(Kernel(row, 1, ExtraSpec(1.0f, V), kNegInfF, 3).mean, kNegInfF);
    // Only finite values but for the one -inf: log_sum_sq stays finite.
    EXPECT_TRUE(std::isfinite(Kernel(row, 1, ExtraSpec(1.0f, V), kNegInfF, 2).log_sum_sq));
  }
}

/// A row whose x are all -inf: no target is top-1 (SPEC; TRL's rule), the
/// mean is -inf.
TEST(KernelExtraOutputs, AllMinusInfinityRowHasNoTop1) {
  const int64_t V = 3000;
  const Row row = MakeRow(v1::F32, std::vector<float>(V, kNegInfF));
  for (int slices = 1; slices <= 3; ++slices)
    for (int64_t t : {int64_t{0}, int64_t{1500}, V - 1}) {
      const Got g = Kernel(row, t, ExtraSpec(1.f, V), kNegInfF, slices);
      EXPECT_EQ(g.top1, 0) << "target " << t << " slices " << slices;
      EXPECT_EQ(g.mean, kNegInfF);
    }
}

/// A one-hot distribution: log_sum_sq_probs = 0; uniform: -log V.
TEST(KernelExtraOutputs, LogSumSqOfOneHotAndUniform) {
  const int64_t V = 4096;
  std::vector<float> uniform(V, 1.25f), onehot(V, -200.f);
  onehot[77] = 100.f;
  for (int slices = 1; slices <= 4; ++slices) {
    const Got u = Kernel(MakeRow(v1::F32, uniform), 5, ExtraSpec(1.f, V), kNegInfF, slices);
    EXPECT_NEAR(u.log_sum_sq, -std::log(static_cast<double>(V)), 1e-5);
    EXPECT_FLOAT_EQ(u.mean, 1.25f);
    EXPECT_EQ(u.top1, 0);  // all tie: id 0 is the argmax
    const Got o = Kernel(MakeRow(v1::F32, onehot), 77, ExtraSpec(1.f, V), kNegInfF, slices);
    EXPECT_NEAR(o.log_sum_sq, 0.0, 1e-6);
    EXPECT_EQ(o.top1, 1);
  }
}

/// Asking for the extras leaves token_logprobs and entropy bitwise as they
/// were, and the extras are computed only when asked (record defaults).
TEST(KernelExtraOutputs, OtherOutputsAreBitwiseUnchangedAndDefaultsWritten) {
  std::mt19937 rng(3);
  const int64_t V = 5000;
  const Row row = MakeRow(v1::BF16, TiedValues(V, rng));
  StatsSpec plain;
  plain.temperature = 0.7f;
  plain.entropy = true;
  plain.vocab_size = V;
  const StatsSpec extra = ExtraSpec(0.7f, V);
  for (int slices = 1; slices <= 3; ++slices) {
    const Got a = Kernel(row, 123, plain, kNegInfF, slices);
    const Got b = Kernel(row, 123, extra, kNegInfF, slices);
    EXPECT_EQ(a.logprob, b.logprob);
    EXPECT_EQ(a.entropy, b.entropy);
    EXPECT_EQ(a.top1, -1) << "not written when not asked";
  }
  std::vector<uint32_t> rec(PartialWords(plain));
  std::vector<float> scratch(kPartialScratchFloats);
  SliceRow sr;
  sr.logits = row.bytes.data();
  sr.target = 10;
  ComputePartial(row.dtype, sr, 0, V, plain, rec.data(), scratch.data());
  double q, zsum;
  float ptm;
  std::memcpy(&q, rec.data() + record::kQWord, 8);
  std::memcpy(&zsum, rec.data() + record::kZSumWord, 8);
  std::memcpy(&ptm, rec.data() + record::kPreTargetMaxWord, 4);
  EXPECT_EQ(q, 0.0);
  EXPECT_EQ(zsum, 0.0);
  EXPECT_EQ(ptm, kNegInfF);
}

}  // namespace
}  // namespace logprob::kernels
