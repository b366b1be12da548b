#include "worker/kernels/row_stats.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace logprob::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int32_t kNoId = std::numeric_limits<int32_t>::max();

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float Float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void PutDouble(uint32_t* at, double d) { std::memcpy(at, &d, 8); }
inline double GetDouble(const uint32_t* at) {
  double d;
  std::memcpy(&d, at, 8);
  return d;
}

/// Independent float accumulators per block (as SIMD lanes would be), so
/// rounding error grows with block/kLanes, not the block length.
constexpr int kLanes = 16;

/// (value, id) ordered "better first": larger value, then lower id.
struct Candidate {
  float x;
  int32_t id;
};
inline bool Better(const Candidate& a, const Candidate& b) {
  return a.x > b.x || (a.x == b.x && a.id < b.id);
}

/// Keeps the K best candidates seen, as a min-heap on Better.
class TopK {
 public:
  explicit TopK(int k) : k_(k) { heap_.reserve(k); }
  void Offer(float x, int32_t id) {
    if (static_cast<int>(heap_.size()) < k_) {
      heap_.push_back({x, id});
      std::push_heap(heap_.begin(), heap_.end(), Better);
    } else if (Better({x, id}, heap_.front())) {
      std::pop_heap(heap_.begin(), heap_.end(), Better);
      heap_.back() = {x, id};
      std::push_heap(heap_.begin(), heap_.end(), Better);
    }
  }
  /// Lowest kept value; candidates at or below it with a higher id cannot
  /// enter (ids arrive in increasing order).
  float Floor() const {
    return static_cast<int>(heap_.size()) < k_ ? kNegInf : heap_.front().x;
  }
  bool Full() const { return static_cast<int>(heap_.size()) == k_; }
  /// Best first; padded with (-inf, kNoId) up to K.
  std::vector<Candidate> Sorted() {
    std::vector<Candidate> out = heap_;
    std::sort(out.begin(), out.end(), Better);
    out.resize(k_, Candidate{kNegInf, kNoId});
    return out;
  }

 private:
  int k_;
  std::vector<Candidate> heap_;
};

}  // namespace

void ComputePartial(DType dtype, const SliceRow& row, int64_t vocab_begin,
                    int64_t len, const StatsSpec& spec, uint32_t* record,
                    float* scratch) {
  const size_t esize = DTypeSize(dtype);
  const float temperature = spec.temperature;
  const bool scale = temperature != 1.0f;
  const bool filtered = row.keep_min > kNegInf;
  double s = 0.0, u = 0.0;
  float m = kNegInf;
  TopK topk(spec.topk);

  for (int64_t b0 = 0; b0 < len; b0 += kPartialScratchFloats) {
    const int64_t n = std::min<int64_t>(kPartialScratchFloats, len - b0);
    float* x = scratch;
    ToFloat(dtype, static_cast<const char*>(row.logits) + b0 * esize, n, x);
    if (scale)
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] / temperature;
    if (filtered)
      for (int64_t i = 0; i < n; ++i)
        if (x[i] < row.keep_min) x[i] = kNegInf;
    float bm = kNegInf;
    for (int64_t i = 0; i < n; ++i) bm = std::max(bm, x[i]);
    if (bm > m) {  // rescale the running sums to the new max
      if (m > kNegInf) {  // u is relative to m: u' = r * (u + s * (m_old - m_new))
        const double r = std::exp(static_cast<double>(m) - bm);
        u = r * (u + s * (static_cast<double>(m) - bm));
        s *= r;
      }
      m = bm;
    }
    if (m > kNegInf) {
      float bs[kLanes] = {0.f}, bu[kLanes] = {0.f};
      for (int64_t i = 0; i < n; ++i) {
        const float d = x[i] - m;
        const float e = std::exp(d);
        bs[i % kLanes] += e;
        bu[i % kLanes] += e > 0.f ? e * d : 0.f;  // e == 0 for x = -inf: no 0 * inf
      }
      for (int l = 0; l < kLanes; ++l) {
        s += bs[l];
        u += bu[l];
      }
    }
    if (spec.topk > 0) {
      for (int64_t i = 0; i < n; ++i) {
        if (!topk.Full() || x[i] > topk.Floor())
          topk.Offer(x[i], static_cast<int32_t>(vocab_begin + b0 + i));
      }
    }
  }

  // Single values at the target and the gather ids (x as above).
  auto x_at = [&](int64_t id) -> float {
    if (id < vocab_begin || id >= vocab_begin + len) return std::nanf("");
    float v;
    ToFloat(dtype, static_cast<const char*>(row.logits) + (id - vocab_begin) * esize, 1, &v);
    if (scale) v = v / temperature;
    return v < row.keep_min ? kNegInf : v;
  };
  record[0] = Bits(m);
  record[1] = Bits(row.target >= 0 ? x_at(row.target) : std::nanf(""));
  PutDouble(record + 2, s);
  PutDouble(record + 4, u);
  uint32_t* g = record + kPartialHeaderWords;
  for (int j = 0; j < spec.gather_k; ++j) g[j] = Bits(x_at(row.gather_ids[j]));
  uint32_t* tv = g + spec.gather_k;
  uint32_t* ti = tv + spec.topk;
  if (spec.topk > 0) {
    const auto best = topk.Sorted();
    for (int j = 0; j < spec.topk; ++j) {
      tv[j] = Bits(best[j].x);
      ti[j] = static_cast<uint32_t>(best[j].id);
    }
  }
}

void CombinePartials(const uint32_t* const* records, int count,
                     const StatsSpec& spec, bool has_target, const RowOutput& out) {
  double M = -std::numeric_limits<double>::infinity();
  for (int r = 0; r < count; ++r) M = std::max<double>(M, Float(records[r][0]));
  double S = 0.0, U = 0.0;
  for (int r = 0; r < count; ++r) {
    const double mr = Float(records[r][0]);
    if (mr == -std::numeric_limits<double>::infinity()) continue;
    const double w = std::exp(mr - M);
    const double sr = GetDouble(records[r] + 2);
    S += sr * w;
    U += (GetDouble(records[r] + 4) + sr * (mr - M)) * w;
  }
  const double logZ = M + std::log(S);

  // The value present in exactly one slice (NaN elsewhere).
  auto pick = [&](size_t word) -> double {
    for (int r = 0; r < count; ++r) {
      const float v = Float(records[r][word]);
      if (!std::isnan(v)) return v;
    }
    return std::nan("");
  };
  if (out.token_logprob) {
    *out.token_logprob = has_target ? static_cast<float>(pick(1) - logZ) : 0.0f;
  }
  if (out.entropy) {
    const double h = std::log(S) - U / S;  // U = sum exp(x - M) (x - M)
    *out.entropy = static_cast<float>(std::max(0.0, h));
  }
  if (out.gathered) {
    for (int j = 0; j < spec.gather_k; ++j)
      out.gathered[j] = static_cast<float>(pick(kPartialHeaderWords + j) - logZ);
  }
  if (spec.topk > 0 && (out.topk_logprobs || out.topk_indices)) {
    std::vector<Candidate> all;
    all.reserve(static_cast<size_t>(count) * spec.topk);
    for (int r = 0; r < count; ++r) {
      const uint32_t* tv = records[r] + kPartialHeaderWords + spec.gather_k;
      const uint32_t* ti = tv + spec.topk;
      for (int j = 0; j < spec.topk; ++j) {
        const auto id = static_cast<int32_t>(ti[j]);
        if (id != kNoId) all.push_back({Float(tv[j]), id});
      }
    }
    const size_t k = std::min<size_t>(spec.topk, all.size());
    std::partial_sort(all.begin(), all.begin() + k, all.end(), Better);
    for (int j = 0; j < spec.topk; ++j) {
      const bool have = static_cast<size_t>(j) < k;
      if (out.topk_logprobs)
        out.topk_logprobs[j] = have ? static_cast<float>(all[j].x - logZ) : kNegInf;
      if (out.topk_indices) out.topk_indices[j] = have ? all[j].id : -1;
    }
  }
}

}  // namespace logprob::kernels
