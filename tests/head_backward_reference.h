// The float64 reference of the lm_head's backward (worker/kernels/head_backward.h)
// shared by its tests: random problems of N rows over a V-id head, their
// forward statistics and gradients in float64, and the tolerance check.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/lm_head_transform.h"

namespace logprob::kernels::backward_reference {

inline constexpr int64_t N = 70, H = 48, V = 300;  // two row tiles (one partial), three column tiles (one partial)

inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
inline float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Case {
  DType weight_dtype;
  LmHeadTransform transform;
  float temperature;
  bool bf16_hidden = false;  // hidden states of bf16 values (exact operands of a bf16 GEMM)
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

inline Problem Make(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  Problem p;
  p.h.resize(N * H);
  for (auto& x : p.h) x = normal(rng);
  if (c.bf16_hidden)
    for (auto& x : p.h) x = FromBf16(ToBf16(x));
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

/// Every element of `got` [n, width] within 1e-4 of its row's largest
/// |reference| plus 1e-7; the first failure, or "".
inline std::string WithinRowTolerance(const std::vector<float>& got, const std::vector<double>& want, int64_t n,
                                      int64_t width, const char* what) {
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

/// Gradients a test computed: dL/dh [rows, H], dL/dW [V, H], dL/db [V].
struct Grads {
  std::vector<float> dh, dw, db;
};

/// "" when every element of `g` (all N rows) is within the tolerance of
/// `p`'s float64 reference (WithinRowTolerance), else the first failure.
inline std::string MatchesReference(const Grads& g, const Problem& p) {
  std::string e = WithinRowTolerance(g.dh, p.dh, N, H, "dL/dh");
  if (e.empty()) e = WithinRowTolerance(g.dw, p.dw, V, H, "dL/dW");
  if (e.empty()) e = WithinRowTolerance(g.db, p.db, 1, V, "dL/db");
  return e;
}

/// The cases both tests run: f32 and bf16 weights; identity, bias +
/// scale, bias + scale + softcap; temperature 1 and 0.7.
inline const Case kCases[] = {
    {v1::F32, LmHeadTransform{}, 1.0f},
    {v1::BF16, LmHeadTransform{}, 0.7f},
    {v1::F32, LmHeadTransform{true, 1.5, 0.0}, 0.7f},
    {v1::BF16, LmHeadTransform{true, 0.8, 5.0}, 1.0f},
};

}  // namespace logprob::kernels::backward_reference
