#include "worker/kernels/row_stats.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace logprob::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

/// (value, id) ordered "better first": larger value, then lower id.
struct Candidate {
  float x;
  int32_t id;
};
/// The top-k order of a value (issue 50): larger first, -0 == +0, NaN (any
/// sign or payload) above every number, as torch.topk ranks it. The same
/// key as the GPU's (worker/cuda/row_common.cuh Key), so both select the
/// same ids; a total order, which the heap and the sorts below need (float
/// comparisons are all false for NaN).
inline uint32_t OrderKey(float x) {
  if (std::isnan(x)) return 0xffffffffu;
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = Bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
inline bool Better(const Candidate& a, const Candidate& b) {
  const uint32_t ka = OrderKey(a.x), kb = OrderKey(b.x);
  return ka > kb || (ka == kb && a.id < b.id);
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
  /// enter (ids arrive in increasing order). NextAbove also stops at every
  /// NaN (above any floor but NaN; Offer decides).
  float Floor() const { return static_cast<int>(heap_.size()) < k_ ? kNegInf : heap_.front().x; }
  bool Full() const { return static_cast<int>(heap_.size()) == k_; }
  /// Best first; padded with (-inf, record::kNoTopkId) up to K.
  std::vector<Candidate> Sorted() {
    std::vector<Candidate> out = heap_;
    std::sort(out.begin(), out.end(), Better);
    out.resize(k_, Candidate{kNegInf, record::kNoTopkId});
    return out;
  }

 private:
  int k_;
  std::vector<Candidate> heap_;
};

/// Removes (-inf) the entries of block x[0, n) (global columns [lo, lo +
/// n)) that are not among the mask's ids; `next` is the index of the first
/// id >= lo and advances past the block. Returns the block's new max.
float MaskBlock(float* x, size_t n, int64_t lo, const SliceRow& row, int64_t* next) {
  float bm = kNegInf;
  const int64_t hi = lo + static_cast<int64_t>(n);
  int64_t k = *next;
  int64_t keep = k < row.keep_count && row.keep_ids[k] < hi ? row.keep_ids[k] - lo : static_cast<int64_t>(n);
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {
    if (i == keep) {
      bm = std::max(bm, x[i]);
      ++k;
      keep = k < row.keep_count && row.keep_ids[k] < hi ? row.keep_ids[k] - lo : static_cast<int64_t>(n);
    } else {
      x[i] = kNegInf;
    }
  }
  *next = k;
  return bm;
}

}  // namespace

void ComputePartial(DType dtype, const SliceRow& row, int64_t vocab_begin, int64_t len, const StatsSpec& spec,
                    uint32_t* out, float* scratch) {
  const size_t esize = DTypeSize(dtype);
  const float temperature = spec.temperature;
  const bool scale = temperature != 1.0f;
  double s = 0.0, u = 0.0;  // u relative to m
  double q = 0.0;           // sum exp(2(x - m)), on request
  double zsum = 0.0;        // sum of x before the filters, on request
  float m = kNegInf;
  // is_top1: max x over the slice's ids < target (local column t_local).
  float pre_target_max = kNegInf;
  const int64_t t_local = spec.is_top1 && row.target >= 0 ? row.target - vocab_begin : 0;
  TopK topk(spec.topk);
  // The mask's first id in this slice.
  int64_t mask_next =
      row.keep_ids ? std::lower_bound(row.keep_ids, row.keep_ids + row.keep_count, vocab_begin) - row.keep_ids : 0;

  for (int64_t b0 = 0; b0 < len; b0 += static_cast<int64_t>(kBlock)) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(kBlock, len - b0));
    float* x = scratch;
    size_t padded = 0;
    float bz = 0.f;
    float bm = PrepareBlock(dtype, static_cast<const char*>(row.logits) + b0 * esize, n, temperature, row.keep_min, x,
                            &padded, spec.mean_logits ? &bz : nullptr);
    if (row.keep_ids) bm = MaskBlock(x, n, vocab_begin + b0, row, &mask_next);
    zsum += bz;
    if (bm > m) {
      if (m > kNegInf) {  // rescale: u' = r * (u + s * (m_old - m_new)), q' = r^2 q
        const double r = std::exp(static_cast<double>(m) - bm);
        u = r * (u + s * (static_cast<double>(m) - bm));
        s *= r;
        q *= r * r;
      }
      m = bm;
    }
    if (m > kNegInf) {
      float bs = 0.f, bu = 0.f, bq = 0.f;
      ExpSums(x, padded, m, &bs, spec.entropy ? &bu : nullptr, spec.log_sum_sq_probs ? &bq : nullptr);
      s += bs;
      u += bu;
      q += bq;
    }
    if (t_local >= b0 + static_cast<int64_t>(n)) {  // the whole block lies before the target
      pre_target_max = std::max(pre_target_max, bm);
    } else if (t_local > b0) {  // the target's block: its columns before the target
      for (int64_t i = 0; i < t_local - b0; ++i) pre_target_max = std::max(pre_target_max, x[i]);
    }
    if (spec.topk > 0) {
      size_t i = 0;
      for (; i < n && !topk.Full(); ++i) topk.Offer(x[i], static_cast<int32_t>(vocab_begin + b0 + i));
      while ((i = NextAbove(x, i, n, topk.Floor())) < n) {
        topk.Offer(x[i], static_cast<int32_t>(vocab_begin + b0 + i));
        ++i;
      }
    }
  }

  // Single values at the target and the gather ids (x as above).
  auto x_at = [&](int64_t id) -> float {
    if (id < vocab_begin || id >= vocab_begin + len) return Float(record::kAbsentXBits);
    float v;
    ToFloat(dtype, static_cast<const char*>(row.logits) + (id - vocab_begin) * esize, 1, &v);
    if (scale) v = v / temperature;
    if (row.keep_ids && !std::binary_search(row.keep_ids, row.keep_ids + row.keep_count, id)) return kNegInf;
    return v < row.keep_min ? kNegInf : v;
  };
  out[record::kMaxWord] = Bits(m);
  out[record::kTargetWord] = row.target >= 0 ? Bits(x_at(row.target)) : record::kAbsentXBits;
  PutDouble(out + record::kSWord, s);
  PutDouble(out + record::kUWord, u);
  PutDouble(out + record::kQWord, q);
  PutDouble(out + record::kZSumWord, zsum);
  out[record::kPreTargetMaxWord] = Bits(pre_target_max);
  out[record::kReservedWord] = 0;
  for (int j = 0; j < spec.gather_k; ++j) out[record::GatherWord(j)] = Bits(x_at(row.gather_ids[j]));
  uint32_t* tv = out + record::TopkValueWord(spec.gather_k, 0);
  uint32_t* ti = out + record::TopkIdWord(spec.gather_k, spec.topk, 0);
  if (spec.topk > 0) {
    const auto best = topk.Sorted();
    for (int j = 0; j < spec.topk; ++j) {
      tv[j] = Bits(best[j].x);
      ti[j] = static_cast<uint32_t>(best[j].id);
    }
  }
}

void CombinePartials(const uint32_t* const* records, int count, const StatsSpec& spec, bool has_target,
                     const RowOutput& out) {
  double M = -std::numeric_limits<double>::infinity();
  for (int r = 0; r < count; ++r) M = std::max<double>(M, Float(records[r][record::kMaxWord]));
  double S = 0.0, U = 0.0, Q = 0.0, Z = 0.0;
  float pre_target_max = kNegInf;
  for (int r = 0; r < count; ++r) {
    Z += GetDouble(records[r] + record::kZSumWord);
    pre_target_max = std::max(pre_target_max, Float(records[r][record::kPreTargetMaxWord]));
    const double mr = Float(records[r][record::kMaxWord]);
    if (mr == -std::numeric_limits<double>::infinity()) continue;
    const double w = std::exp(mr - M);
    const double sr = GetDouble(records[r] + record::kSWord);
    S += sr * w;
    U += (GetDouble(records[r] + record::kUWord) + sr * (mr - M)) * w;
    Q += GetDouble(records[r] + record::kQWord) * (w * w);
  }
  const double logZ = M + std::log(S);

  // The value present in exactly one slice (NaN elsewhere).
  auto pick = [&](int64_t word) -> double {
    for (int r = 0; r < count; ++r) {
      const float v = Float(records[r][word]);
      if (!std::isnan(v)) return v;
    }
    return std::nan("");
  };
  if (out.logsumexp) *out.logsumexp = static_cast<float>(logZ);
  if (out.token_logprob) {
    *out.token_logprob = has_target ? static_cast<float>(pick(record::kTargetWord) - logZ) : 0.0f;
  }
  if (spec.entropy && out.entropy) {
    const double h = std::log(S) - U / S;  // U = sum exp(x - M) (x - M)
    *out.entropy = static_cast<float>(std::max(0.0, h));
  }
  if (spec.log_sum_sq_probs && out.log_sum_sq_probs) {
    *out.log_sum_sq_probs = has_target ? static_cast<float>(std::log(Q) - 2.0 * std::log(S)) : 0.0f;
  }
  if (spec.mean_logits && out.mean_logits) {
    *out.mean_logits = has_target ? static_cast<float>(Z / static_cast<double>(spec.vocab_size)) : 0.0f;
  }
  if (spec.is_top1 && out.is_top1) {
    const double tx = has_target ? pick(record::kTargetWord) : std::nan("");
    *out.is_top1 = (tx >= M && tx > pre_target_max) ? 1 : 0;  // NaN (no target) compares false
  }
  if (out.gathered) {
    for (int j = 0; j < spec.gather_k; ++j) out.gathered[j] = static_cast<float>(pick(record::GatherWord(j)) - logZ);
  }
  if (spec.topk > 0 && (out.topk_logprobs || out.topk_indices)) {
    std::vector<Candidate> all;
    all.reserve(static_cast<size_t>(count) * spec.topk);
    for (int r = 0; r < count; ++r) {
      const uint32_t* tv = records[r] + record::TopkValueWord(spec.gather_k, 0);
      const uint32_t* ti = records[r] + record::TopkIdWord(spec.gather_k, spec.topk, 0);
      for (int j = 0; j < spec.topk; ++j) {
        const auto id = static_cast<int32_t>(ti[j]);
        if (id != record::kNoTopkId) all.push_back({Float(tv[j]), id});
      }
    }
    const size_t k = std::min<size_t>(spec.topk, all.size());
    std::partial_sort(all.begin(), all.begin() + k, all.end(), Better);
    for (int j = 0; j < spec.topk; ++j) {
      const bool have = static_cast<size_t>(j) < k;
      if (out.topk_logprobs) out.topk_logprobs[j] = have ? static_cast<float>(all[j].x - logZ) : kNegInf;
      if (out.topk_indices) out.topk_indices[j] = have ? all[j].id : -1;
    }
  }
}

}  // namespace logprob::kernels
