// A distillation problem and its float64 reference, shared by the tests of
// the divergence pass and of the distillation work item: a student head
// (hidden size 48) and a teacher head (hidden size 64) over V = 300, N = 40
// rows of random hidden states, upstream gradients of the divergence and
// of the cross entropy; the float64 divergence (TRL's definition for the
// case's beta), soft-target cross entropy, student entropy and the
// student's dL/dh, dL/dW, dL/db (worker/kernels/divergence.h's math).
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/lm_head_transform.h"

namespace logprob::distillation_reference {

inline constexpr int64_t N = 40, V = 300, Hs = 48, Ht = 64;

struct Case {
  double beta;
  float temperature;
  LmHeadTransform student, teacher;
};

inline const Case kCases[] = {
    {0.0, 1.0f, LmHeadTransform{true, 1.2, 0.0}, LmHeadTransform{false, 1.0, 5.0}},
    {0.5, 0.7f, LmHeadTransform{true, 1.2, 0.0}, LmHeadTransform{false, 1.0, 5.0}},
    {1.0, 1.0f, LmHeadTransform{false, 1.0, 4.0}, LmHeadTransform{false, 0.9, 0.0}},
    {0.2, 0.7f, LmHeadTransform{true, 1.0, 6.0}, LmHeadTransform{true, 1.1, 0.0}},
};

struct Problem {
  std::vector<float> hs, ht, ws, wt, bs, bt, g_d, g_ce;
  // float64 references
  std::vector<double> d, ce, ent, dh, dw, db;
};

inline double Transform(double y, double b, const LmHeadTransform& t) {
  double z = (y + (t.has_bias ? b : 0.0)) * t.logit_scale;
  if (t.softcap != 0) z = t.softcap * std::tanh(z / t.softcap);
  return z;
}

inline Problem Make(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  Problem p;
  auto fill = [&](std::vector<float>& v, size_t n, float s) {
    v.resize(n);
    for (auto& x : v) x = s * normal(rng);
  };
  fill(p.hs, N * Hs, 1.0f);
  fill(p.ht, N * Ht, 1.0f);
  fill(p.ws, V * Hs, 0.3f);
  fill(p.wt, V * Ht, 0.3f);
  fill(p.bs, V, 0.5f);
  fill(p.bt, V, 0.5f);
  fill(p.g_d, N, 1.0f);
  fill(p.g_ce, N, 0.5f);
  const double T = c.temperature, beta = c.beta;
  p.d.resize(N);
  p.ce.resize(N);
  p.ent.resize(N);
  p.dh.assign(N * Hs, 0.0);
  p.dw.assign(V * Hs, 0.0);
  p.db.assign(V, 0.0);
  std::vector<double> zs(V), xs(V), xt(V);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t v = 0; v < V; ++v) {
      double ys = 0, yt = 0;
      for (int64_t k = 0; k < Hs; ++k) ys += static_cast<double>(p.hs[i * Hs + k]) * p.ws[v * Hs + k];
      for (int64_t k = 0; k < Ht; ++k) yt += static_cast<double>(p.ht[i * Ht + k]) * p.wt[v * Ht + k];
      zs[v] = Transform(ys, p.bs[v], c.student);
      xs[v] = zs[v] / T;
      xt[v] = Transform(yt, p.bt[v], c.teacher) / T;
    }
    double ms = -INFINITY, mt = -INFINITY;
    for (int64_t v = 0; v < V; ++v) ms = std::max(ms, xs[v]), mt = std::max(mt, xt[v]);
    double ss = 0, st = 0;
    for (int64_t v = 0; v < V; ++v) ss += std::exp(xs[v] - ms), st += std::exp(xt[v] - mt);
    const double lse_s = ms + std::log(ss), lse_t = mt + std::log(st);
    double ent = 0, ce = 0, fkl = 0, rkl = 0, jsd = 0, kl_m = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double ls = xs[v] - lse_s, lt = xt[v] - lse_t, ps = std::exp(ls), pt = std::exp(lt);
      ent -= ps * ls;
      ce -= pt * ls;
      fkl += pt * (lt - ls);
      rkl += ps * (ls - lt);
      if (beta > 0 && beta < 1) {
        const double lm = std::log((1 - beta) * ps + beta * pt);
        kl_m += ps * (ls - lm);
        jsd += beta * pt * (lt - lm);
      }
    }
    jsd += (1 - beta) * kl_m;
    p.d[i] = beta == 0 ? fkl : beta == 1 ? rkl : jsd;
    p.ce[i] = ce;
    p.ent[i] = ent;
    for (int64_t v = 0; v < V; ++v) {
      const double ls = xs[v] - lse_s, lt = xt[v] - lse_t, ps = std::exp(ls), pt = std::exp(lt);
      double g;
      if (beta == 0) {
        g = ps - pt;
      } else if (beta == 1) {
        g = ps * (ls - lt - rkl);
      } else {
        g = (1 - beta) * ps * (ls - std::log((1 - beta) * ps + beta * pt) - kl_m);
      }
      double gy = (p.g_d[i] * g + p.g_ce[i] * (ps - pt)) / T * c.student.logit_scale;
      if (c.student.softcap != 0) gy *= 1 - (zs[v] / c.student.softcap) * (zs[v] / c.student.softcap);
      p.db[v] += gy;
      for (int64_t k = 0; k < Hs; ++k) {
        p.dh[i * Hs + k] += gy * p.ws[v * Hs + k];
        p.dw[v * Hs + k] += gy * p.hs[i * Hs + k];
      }
    }
  }
  return p;
}

}  // namespace logprob::distillation_reference
