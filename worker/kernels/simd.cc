// Highway per-target implementations of simd.h (compiled once per target
// through hwy/foreach_target.h).
// Highway needs this include order (no clang-format sorting).
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "worker/kernels/simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "worker/kernels/simd.h"
// clang-format on

#include <cmath>
#include <limits>

HWY_BEFORE_NAMESPACE();
namespace logprob::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

float PrepareBlockImpl(DType dtype, const void* src, size_t n, float temperature, float keep_min, float* dst,
                       size_t* padded, float* sum) {
  const hn::ScalableTag<float> df;
  const size_t L = hn::Lanes(df);
  const float ninf = -std::numeric_limits<float>::infinity();
  const auto vinf = hn::Set(df, ninf);
  const auto vt = hn::Set(df, temperature);
  const auto vkeep = hn::Set(df, keep_min);
  const bool scale = temperature != 1.0f, filter = keep_min > ninf;
  auto vmax = vinf, vsum = hn::Zero(df);
  size_t i = 0;
  // `live`: the lanes that hold elements (all but in the padded tail).
  auto finish = [&](hn::Vec<decltype(df)> v, hn::Mask<decltype(df)> live) {
    if (scale) v = hn::Div(v, vt);
    if (sum) vsum = hn::Add(vsum, hn::IfThenElseZero(live, v));
    if (filter) v = hn::IfThenElse(hn::Lt(v, vkeep), vinf, v);
    vmax = hn::Max(vmax, v);
    return v;
  };
  const auto all = hn::FirstN(df, L);
  if (dtype == v1::F32) {
    const float* p = static_cast<const float*>(src);
    for (; i + L <= n; i += L) hn::StoreU(finish(hn::LoadU(df, p + i), all), df, dst + i);
  } else if (dtype == v1::BF16) {
    const hn::Rebind<uint16_t, decltype(df)> d16;
    const hn::RebindToUnsigned<decltype(df)> du32;
    const uint16_t* p = static_cast<const uint16_t*>(src);
    for (; i + L <= n; i += L) {
      const auto w = hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(d16, p + i)));
      hn::StoreU(finish(hn::BitCast(df, w), all), df, dst + i);
    }
  } else {
    const hn::Rebind<hwy::float16_t, decltype(df)> dh;
    const hwy::float16_t* p = static_cast<const hwy::float16_t*>(src);
    for (; i + L <= n; i += L) hn::StoreU(finish(hn::PromoteTo(df, hn::LoadU(dh, p + i)), all), df, dst + i);
  }
  // Tail: scalar conversion, then the same vector path on a padded vector.
  const size_t pad_to = ((n + 2 * L - 1) / (2 * L)) * (2 * L);
  if (i < n) {
    ToFloat(dtype, static_cast<const char*>(src) + i * DTypeSize(dtype), n - i, dst + i);
    for (size_t j = n; j < i + L; ++j) dst[j] = ninf;
    hn::StoreU(finish(hn::LoadU(df, dst + i), hn::FirstN(df, n - i)), df, dst + i);
    i += L;
  }
  for (; i < pad_to; ++i) dst[i] = ninf;
  *padded = pad_to;
  if (sum) *sum = hn::GetLane(hn::SumOfLanes(df, vsum));
  return hn::GetLane(hn::MaxOfLanes(df, vmax));
}

/// exp(x) for x <= 0 (x = logit - running max): 2^t with t = x log2(e) split
/// as n + f, |f| <= 0.5, 2^f by its degree-6 Taylor polynomial (relative
/// error < 1.3e-7, float32 rounding), 2^n added to the exponent bits; 0
/// below -87 (and for -inf / NaN). Cheaper than hwy::Exp, which also
/// handles positive arguments.
template <class D, class V>
HWY_INLINE V ExpNonPositive(D d, V x) {
  const hn::RebindToSigned<D> di;
  const V t = hn::Mul(x, hn::Set(d, 1.44269504088896341f));
  const V n = hn::Round(t);
  const V f = hn::Sub(t, n);
  V p = hn::Set(d, 1.5403530393381606e-4f);                  // ln2^6 / 720
  p = hn::MulAdd(p, f, hn::Set(d, 1.3333558146428443e-3f));  // ln2^5 / 120
  p = hn::MulAdd(p, f, hn::Set(d, 9.6181291076284772e-3f));  // ln2^4 / 24
  p = hn::MulAdd(p, f, hn::Set(d, 5.5504108664821580e-2f));  // ln2^3 / 6
  p = hn::MulAdd(p, f, hn::Set(d, 0.24022650695910072f));    // ln2^2 / 2
  p = hn::MulAdd(p, f, hn::Set(d, 0.69314718055994531f));    // ln2
  p = hn::MulAdd(p, f, hn::Set(d, 1.0f));
  const V r = hn::BitCast(d, hn::Add(hn::BitCast(di, p), hn::ShiftLeft<23>(hn::ConvertTo(di, n))));
  return hn::IfThenElseZero(hn::Ge(x, hn::Set(d, -87.0f)), r);
}

/// ExpSums with the sums chosen at compile time (kU: u, kQ: q).
template <bool kU, bool kQ>
HWY_INLINE void ExpSumsT(const float* x, size_t n, float m, float* s, float* u, float* q) {
  const hn::ScalableTag<float> df;
  const size_t L = hn::Lanes(df);
  const auto vm = hn::Set(df, m);
  const auto zero = hn::Zero(df);
  auto s0 = zero, s1 = zero, u0 = zero, u1 = zero, q0 = zero, q1 = zero;
  for (size_t i = 0; i + 2 * L <= n; i += 2 * L) {
    const auto d0 = hn::Sub(hn::LoadU(df, x + i), vm);
    const auto d1 = hn::Sub(hn::LoadU(df, x + i + L), vm);
    const auto e0 = ExpNonPositive(df, d0);
    const auto e1 = ExpNonPositive(df, d1);
    s0 = hn::Add(s0, e0);
    s1 = hn::Add(s1, e1);
    if (kU) {  // exp(d) == 0 (d = -inf or far below): no 0 * inf.
      u0 = hn::Add(u0, hn::IfThenElseZero(hn::Gt(e0, zero), hn::Mul(e0, d0)));
      u1 = hn::Add(u1, hn::IfThenElseZero(hn::Gt(e1, zero), hn::Mul(e1, d1)));
    }
    if (kQ) {  // exp(2d) = exp(d)^2
      q0 = hn::MulAdd(e0, e0, q0);
      q1 = hn::MulAdd(e1, e1, q1);
    }
  }
  *s = hn::GetLane(hn::SumOfLanes(df, hn::Add(s0, s1)));
  if (kU) *u = hn::GetLane(hn::SumOfLanes(df, hn::Add(u0, u1)));
  if (kQ) *q = hn::GetLane(hn::SumOfLanes(df, hn::Add(q0, q1)));
}

void ExpSumsImpl(const float* x, size_t n, float m, float* s, float* u, float* q) {
  if (u && q) return ExpSumsT<true, true>(x, n, m, s, u, q);
  if (u) return ExpSumsT<true, false>(x, n, m, s, u, q);
  if (q) return ExpSumsT<false, true>(x, n, m, s, u, q);
  return ExpSumsT<false, false>(x, n, m, s, u, q);  // token logprobs only: the sum of exponentials
}

size_t NextAboveImpl(const float* x, size_t begin, size_t n, float floor) {
  const hn::ScalableTag<float> df;
  const size_t L = hn::Lanes(df);
  const auto vf = hn::Set(df, floor);
  size_t i = begin;
  for (; i + L <= n; i += L) {
    const auto v = hn::LoadU(df, x + i);
    const auto mask = hn::Or(hn::Gt(v, vf), hn::IsNaN(v));
    if (!hn::AllFalse(df, mask)) return i + static_cast<size_t>(hn::FindFirstTrue(df, mask));
  }
  for (; i < n; ++i)
    if (x[i] > floor || x[i] != x[i]) return i;
  return n;
}

void WidenToFloatImpl(DType dtype, const void* src, size_t n, float* dst) {
  if (n == 0) return;  // src and dst may be null
  const hn::ScalableTag<float> df;
  const size_t L = hn::Lanes(df);
  size_t i = 0;
  if (dtype == v1::BF16) {  // bf16 is the high half of an f32: widen and shift
    const hn::Rebind<uint16_t, decltype(df)> d16;
    const hn::RebindToUnsigned<decltype(df)> du32;
    const uint16_t* p = static_cast<const uint16_t*>(src);
    for (; i + L <= n; i += L)
      hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(d16, p + i)))), df, dst + i);
  } else if (dtype == v1::F16) {
    const hn::Rebind<hwy::float16_t, decltype(df)> dh;
    const hwy::float16_t* p = static_cast<const hwy::float16_t*>(src);
    for (; i + L <= n; i += L) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, p + i)), df, dst + i);
  }
  ToFloat(dtype, static_cast<const char*>(src) + i * DTypeSize(dtype), n - i, dst + i);  // the tail; F32: all
}

}  // namespace HWY_NAMESPACE
}  // namespace logprob::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace logprob::kernels {

HWY_EXPORT(PrepareBlockImpl);
HWY_EXPORT(ExpSumsImpl);
HWY_EXPORT(NextAboveImpl);
HWY_EXPORT(WidenToFloatImpl);

float PrepareBlock(DType dtype, const void* src, size_t n, float temperature, float keep_min, float* dst,
                   size_t* padded, float* sum) {
  return HWY_DYNAMIC_DISPATCH(PrepareBlockImpl)(dtype, src, n, temperature, keep_min, dst, padded, sum);
}

void ExpSums(const float* x, size_t n, float m, float* s, float* u, float* q) {
  HWY_DYNAMIC_DISPATCH(ExpSumsImpl)(x, n, m, s, u, q);
}

size_t NextAbove(const float* x, size_t begin, size_t n, float floor) {
  return HWY_DYNAMIC_DISPATCH(NextAboveImpl)(x, begin, n, floor);
}

void WidenToFloat(DType dtype, const void* src, size_t n, float* dst) {
  HWY_DYNAMIC_DISPATCH(WidenToFloatImpl)(dtype, src, n, dst);
}

}  // namespace logprob::kernels
#endif
