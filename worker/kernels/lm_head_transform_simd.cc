// Highway per-target implementation of lm_head_transform_simd.h (compiled
// once per target through hwy/foreach_target.h).
// Highway needs this include order (no clang-format sorting).
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "worker/kernels/lm_head_transform_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"
#include "worker/kernels/lm_head_transform_simd.h"
// clang-format on

#include <algorithm>
#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace logprob::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr size_t kMaxLanes = 64;  // floats of the widest vector (2048-bit SVE)

void TransformImpl(const float* bias, int64_t M, int64_t N, float scale, float softcap, float* logits) {
  const hn::ScalableTag<float> df;
  const size_t L = std::min(hn::Lanes(df), kMaxLanes);
  const auto vscale = hn::Set(df, scale);
  const auto vcap = hn::Set(df, softcap);
  const auto zero = hn::Zero(df);
  // The one sequence of lane-wise operations every element goes through.
  auto transform = [&](hn::Vec<decltype(df)> x, hn::Vec<decltype(df)> b) {
    auto z = hn::Mul(hn::Add(x, b), vscale);
    if (softcap != 0.0f) z = hn::Mul(vcap, hn::Tanh(df, hn::Div(z, vcap)));
    return z;
  };
  HWY_ALIGN float tail_x[kMaxLanes];
  HWY_ALIGN float tail_b[kMaxLanes];
  const size_t n = static_cast<size_t>(N);
  for (int64_t m = 0; m < M; ++m) {
    float* row = logits + m * N;
    size_t i = 0;
    for (; i + L <= n; i += L) {
      const auto b = bias != nullptr ? hn::LoadU(df, bias + i) : zero;
      hn::StoreU(transform(hn::LoadU(df, row + i), b), df, row + i);
    }
    if (i < n) {  // the ragged end, through one padded vector
      const size_t r = n - i;
      std::fill(tail_x, tail_x + L, 0.0f);
      std::fill(tail_b, tail_b + L, 0.0f);
      std::memcpy(tail_x, row + i, r * sizeof(float));
      if (bias != nullptr) std::memcpy(tail_b, bias + i, r * sizeof(float));
      hn::StoreU(transform(hn::LoadU(df, tail_x), hn::LoadU(df, tail_b)), df, tail_x);
      std::memcpy(row + i, tail_x, r * sizeof(float));
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace logprob::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace logprob::kernels {

HWY_EXPORT(TransformImpl);

void ApplyLmHeadTransformSimd(const LmHeadTransform& t, const float* bias, int64_t M, int64_t N, float* logits) {
  if (t.identity() || M <= 0 || N <= 0) return;
  HWY_DYNAMIC_DISPATCH(TransformImpl)
  (t.has_bias ? bias : nullptr, M, N, static_cast<float>(t.logit_scale), static_cast<float>(t.softcap), logits);
}

}  // namespace logprob::kernels
#endif  // HWY_ONCE
