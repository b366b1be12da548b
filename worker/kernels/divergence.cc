#include "worker/kernels/divergence.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace logprob::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// x = z / T as the logprob kernels compute it: float32, rounded once.
inline double X(float z, float temperature) { return temperature != 1.0f ? z / temperature : z; }

/// log(e^a + e^b) with -inf handled.
inline double LogAddExp(double a, double b) {
  const double top = std::max(a, b);
  if (top == -kInf) return -kInf;
  return top + std::log(std::exp(a - top) + std::exp(b - top));
}

/// s * e^(m - M): a slice's sum rescaled to the row's maximum (0 for an
/// empty slice or a slice whose maximum is -inf).
inline double Rescaled(double s, double m, double M) { return m == -kInf ? 0.0 : s * std::exp(m - M); }

}  // namespace

DivergenceKind DivergenceKindOf(double beta) {
  return beta == 0.0 ? DivergenceKind::kForwardKl : beta == 1.0 ? DivergenceKind::kReverseKl : DivergenceKind::kJsd;
}

DivergencePartial SliceDivergencePartial(const float* zs, const float* zt, int64_t C, float temperature) {
  DivergencePartial p{-kInf, 0, 0, 0, -kInf, 0, 0, 0};
  for (int64_t v = 0; v < C; ++v) {
    p.s_max = std::max(p.s_max, X(zs[v], temperature));
    p.t_max = std::max(p.t_max, X(zt[v], temperature));
  }
  for (int64_t v = 0; v < C; ++v) {
    const double xs = X(zs[v], temperature), xt = X(zt[v], temperature);
    const double es = p.s_max == -kInf ? 0.0 : std::exp(xs - p.s_max);
    const double et = p.t_max == -kInf ? 0.0 : std::exp(xt - p.t_max);
    if (es != 0.0) {
      p.s_sum += es;
      p.s_x += es * xs;
      p.s_gap += es * (xs - xt);  // +inf where the teacher rules the token out
    }
    if (et != 0.0) {
      p.t_sum += et;
      p.t_gap += et * (xt - xs);  // +inf where the student rules it out
      p.t_xs += et * xs;
    }
  }
  return p;
}

DivergenceRow CombineDivergencePartials(const DivergencePartial* const* parts, int W) {
  double sm = -kInf, tm = -kInf;
  for (int q = 0; q < W; ++q) {
    sm = std::max(sm, parts[q]->s_max);
    tm = std::max(tm, parts[q]->t_max);
  }
  double s_sum = 0, s_x = 0, s_gap = 0, t_sum = 0, t_gap = 0, t_xs = 0;
  for (int q = 0; q < W; ++q) {  // rank order
    const DivergencePartial& p = *parts[q];
    s_sum += Rescaled(p.s_sum, p.s_max, sm);
    s_x += Rescaled(p.s_x, p.s_max, sm);
    s_gap += Rescaled(p.s_gap, p.s_max, sm);
    t_sum += Rescaled(p.t_sum, p.t_max, tm);
    t_gap += Rescaled(p.t_gap, p.t_max, tm);
    t_xs += Rescaled(p.t_xs, p.t_max, tm);
  }
  DivergenceRow r;
  r.lse_s = sm + std::log(s_sum);
  r.lse_t = tm + std::log(t_sum);
  r.entropy_s = r.lse_s - s_x / s_sum;
  r.cross_entropy = r.lse_s - t_xs / t_sum;
  r.forward_kl = t_gap / t_sum - r.lse_t + r.lse_s;
  r.reverse_kl = s_gap / s_sum - r.lse_s + r.lse_t;
  return r;
}

JsdPartial SliceJsdPartial(const float* zs, const float* zt, int64_t C, float temperature, double beta, double lse_s,
                           double lse_t) {
  JsdPartial p;
  const double log_1mb = std::log(1.0 - beta), log_b = std::log(beta);
  for (int64_t v = 0; v < C; ++v) {
    const double log_ps = X(zs[v], temperature) - lse_s, log_pt = X(zt[v], temperature) - lse_t;
    const double log_m = LogAddExp(log_ps + log_1mb, log_pt + log_b);
    const double ps = std::exp(log_ps), pt = std::exp(log_pt);
    const double kl_s = ps != 0.0 ? ps * (log_ps - log_m) : 0.0;
    const double kl_t = pt != 0.0 ? pt * (log_pt - log_m) : 0.0;
    p.jsd += beta * kl_t + (1.0 - beta) * kl_s;
    p.kl_student += kl_s;
  }
  return p;
}

void DivergenceLogitGradients(const LmHeadTransform& student, float temperature, double beta,
                              const DivergenceGradRow& row, const float* zt, int64_t C, float* zs) {
  const double scale = static_cast<float>(student.logit_scale), cap = static_cast<float>(student.softcap);
  const double inv_t = 1.0 / static_cast<double>(temperature);
  const DivergenceKind kind = DivergenceKindOf(beta);
  const double log_1mb = kind == DivergenceKind::kJsd ? std::log(1.0 - beta) : 0.0;
  const double log_b = kind == DivergenceKind::kJsd ? std::log(beta) : 0.0;
  for (int64_t v = 0; v < C; ++v) {
    const double log_ps = X(zs[v], temperature) - row.lse_s, log_pt = X(zt[v], temperature) - row.lse_t;
    const double ps = std::exp(log_ps), pt = std::exp(log_pt);
    double g = 0.0;
    if (kind == DivergenceKind::kForwardKl) {
      g = ps - pt;
    } else if (ps != 0.0) {  // a token the student rules out has no gradient
      if (kind == DivergenceKind::kReverseKl) {
        g = ps * (log_ps - log_pt - row.aux);
      } else {
        const double log_m = LogAddExp(log_ps + log_1mb, log_pt + log_b);
        g = (1.0 - beta) * ps * (log_ps - log_m - row.aux);
      }
    }
    double gx = row.grad_divergence * g + row.grad_cross_entropy * (ps - pt);
    double gy = gx * inv_t * scale;
    if (cap != 0.0) {
      const double r = static_cast<double>(zs[v]) / cap;
      gy *= 1.0 - r * r;
    }
    zs[v] = static_cast<float>(gy);
  }
}

void SliceDivergencePartials(const float* zs, const float* zt, int64_t m, int64_t C, float temperature,
                             DivergencePartial* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) out[i] = SliceDivergencePartial(zs + i * C, zt + i * C, C, temperature);
}

void SliceJsdPartials(const float* zs, const float* zt, int64_t m, int64_t C, float temperature, double beta,
                      const double* lse_s, const double* lse_t, JsdPartial* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i)
    out[i] = SliceJsdPartial(zs + i * C, zt + i * C, C, temperature, beta, lse_s[i], lse_t[i]);
}

void DivergenceLogitGradientsRows(const LmHeadTransform& student, float temperature, double beta,
                                  const DivergenceGradRow* rows, const float* zt, int64_t m, int64_t C, float* zs) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i)
    DivergenceLogitGradients(student, temperature, beta, rows[i], zt + i * C, C, zs + i * C);
}

}  // namespace logprob::kernels
