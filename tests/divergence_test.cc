// Distillation divergences over vocabulary slices (worker/kernels/
// divergence.h) against a float64 reference computed over the whole row:
// the values combined from 1, 3 and 5 slices (one of them empty when the
// vocabulary is shorter than the workers), forward KL, reverse KL, JSD at
// several beta, the student's entropy and the soft-target cross entropy,
// temperature 1 and 0.7, -inf logits; the student's gradient of the GEMM
// output against central finite differences of the float64 loss (through
// the head's scale and softcap), so the closed forms themselves are
// checked, not only their arithmetic.
#include "worker/kernels/divergence.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/lm_head_logit.h"

namespace logprob::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// The float64 values of one row over its whole vocabulary, from the
/// student's and the teacher's x = z / T.
struct Reference {
  double lse_s, lse_t, entropy_s, cross_entropy, forward_kl, reverse_kl, jsd, kl_student_m;
};

double Lse(const std::vector<double>& x) {
  double m = -kInf;
  for (double v : x) m = std::max(m, v);
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

Reference Ref(const std::vector<double>& xs, const std::vector<double>& xt, double beta) {
  Reference r{};
  r.lse_s = Lse(xs);
  r.lse_t = Lse(xt);
  for (size_t v = 0; v < xs.size(); ++v) {
    const double ls = xs[v] - r.lse_s, lt = xt[v] - r.lse_t, ps = std::exp(ls), pt = std::exp(lt);
    if (ps > 0) r.entropy_s -= ps * ls;
    if (pt > 0) r.cross_entropy -= pt * ls;
    if (pt > 0) r.forward_kl += pt * (lt - ls);
    if (ps > 0) r.reverse_kl += ps * (ls - lt);
    if (beta > 0 && beta < 1) {
      const double m = (1 - beta) * ps + beta * pt;
      if (ps > 0) r.kl_student_m += ps * (ls - std::log(m));
      if (pt > 0) r.jsd += beta * pt * (lt - std::log(m));
    }
  }
  r.jsd += (1 - beta) * r.kl_student_m;
  return r;
}

double Divergence(const Reference& r, double beta) {
  return beta == 0 ? r.forward_kl : beta == 1 ? r.reverse_kl : r.jsd;
}

/// The transformed logit in float64 (softcap(scale * y)).
double Z(double y, double scale, double cap) {
  const double z = y * scale;
  return cap != 0 ? cap * std::tanh(z / cap) : z;
}

struct Row {
  std::vector<float> ys, zs, zt;  // the student's GEMM output and transformed logits; the teacher's logits
};

Row MakeRow(int64_t V, uint32_t seed, const LmHeadTransform& t, bool minus_inf) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  Row r;
  for (int64_t v = 0; v < V; ++v) {
    r.ys.push_back(2.0f * normal(rng));
    r.zs.push_back(TransformLogit(r.ys.back(), 0.0f, static_cast<float>(t.logit_scale), static_cast<float>(t.softcap)));
    r.zt.push_back(2.5f * normal(rng));
  }
  if (minus_inf) {
    // The teacher rules out two tokens; the student rules out one of them.
    r.zt[1] = r.zt[V - 2] = -std::numeric_limits<float>::infinity();
    r.zs[1] = -std::numeric_limits<float>::infinity();
  }
  return r;
}

std::vector<double> Xs(const std::vector<float>& z, float T) {
  std::vector<double> x;
  for (float v : z) x.push_back(T != 1.0f ? v / T : v);
  return x;
}

/// The combined first-round row over W slices and, for the JSD, the
/// second round; `jsd`, `kl_student`: its results.
DivergenceRow Combined(const Row& r, int W, float T, double beta, double* jsd, double* kl_student) {
  const int64_t V = static_cast<int64_t>(r.zs.size());
  std::vector<DivergencePartial> parts(W);
  std::vector<const DivergencePartial*> ptr(W);
  for (int q = 0; q < W; ++q) {
    const int64_t b = V * q / W, e = V * (q + 1) / W;
    parts[q] = SliceDivergencePartial(r.zs.data() + b, r.zt.data() + b, e - b, T);
    ptr[q] = &parts[q];
  }
  const DivergenceRow row = CombineDivergencePartials(ptr.data(), W);
  *jsd = *kl_student = 0;
  if (beta > 0 && beta < 1)
    for (int q = 0; q < W; ++q) {
      const int64_t b = V * q / W, e = V * (q + 1) / W;
      const JsdPartial p = SliceJsdPartial(r.zs.data() + b, r.zt.data() + b, e - b, T, beta, row.lse_s, row.lse_t);
      *jsd += p.jsd;
      *kl_student += p.kl_student;
    }
  return row;
}

void ExpectNear(double got, double want, const char* what) {
  if (std::isinf(want)) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  EXPECT_NEAR(got, want, 1e-11 * std::max(1.0, std::abs(want))) << what;
}

class DivergenceValues : public ::testing::TestWithParam<std::tuple<int, float, bool>> {};

TEST_P(DivergenceValues, SlicesCombineToTheFloat64Row) {
  const auto [W, T, minus_inf] = GetParam();
  for (int64_t V : {2, 37, 1000}) {
    if (minus_inf && V < 4) continue;
    const Row r = MakeRow(V, static_cast<uint32_t>(V + W), LmHeadTransform{}, minus_inf);
    for (double beta : {0.0, 0.1, 0.5, 1.0}) {
      double jsd = 0, kl_student = 0;
      const DivergenceRow got = Combined(r, W, T, beta, &jsd, &kl_student);
      const Reference want = Ref(Xs(r.zs, T), Xs(r.zt, T), beta);
      SCOPED_TRACE(::testing::Message() << "V " << V << ", beta " << beta);
      ExpectNear(got.lse_s, want.lse_s, "lse_s");
      ExpectNear(got.lse_t, want.lse_t, "lse_t");
      ExpectNear(got.entropy_s, want.entropy_s, "entropy_s");
      ExpectNear(got.cross_entropy, want.cross_entropy, "cross_entropy");
      ExpectNear(got.forward_kl, want.forward_kl, "forward_kl");
      if (!minus_inf) ExpectNear(got.reverse_kl, want.reverse_kl, "reverse_kl");
      if (beta > 0 && beta < 1) {
        ExpectNear(jsd, want.jsd, "jsd");
        ExpectNear(kl_student, want.kl_student_m, "kl_student");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Slices, DivergenceValues,
                         ::testing::Combine(::testing::Values(1, 3, 5), ::testing::Values(1.0f, 0.7f),
                                            ::testing::Bool()));

TEST(DivergenceValues, ATokenTheStudentRulesOutButNotTheTeacherMakesTheForwardKlInfinite) {
  Row r = MakeRow(8, 3, LmHeadTransform{}, false);
  r.zs[2] = -std::numeric_limits<float>::infinity();
  double jsd = 0, kl = 0;
  const DivergenceRow got = Combined(r, 3, 1.0f, 0.0, &jsd, &kl);
  EXPECT_EQ(got.forward_kl, kInf);
  EXPECT_EQ(got.cross_entropy, kInf);
  EXPECT_TRUE(std::isfinite(got.reverse_kl));
  EXPECT_TRUE(std::isfinite(got.entropy_s));
}

/// The float64 loss g_D D + g_CE CE of the student's GEMM output ys.
double Loss(const std::vector<double>& ys, const std::vector<double>& xt, const LmHeadTransform& t, double T,
            double beta, double g_d, double g_ce) {
  std::vector<double> xs;
  for (double y : ys) xs.push_back(Z(y, t.logit_scale, t.softcap) / T);
  const Reference r = Ref(xs, xt, beta);
  return g_d * Divergence(r, beta) + g_ce * r.cross_entropy;
}

class DivergenceGradient : public ::testing::TestWithParam<std::tuple<double, float, int>> {};

TEST_P(DivergenceGradient, MatchesFiniteDifferencesOfTheFloat64Loss) {
  const auto [beta, T, transform_index] = GetParam();
  const LmHeadTransform transforms[] = {LmHeadTransform{}, LmHeadTransform{false, 1.5, 0.0},
                                        LmHeadTransform{false, 0.8, 5.0}};
  const LmHeadTransform& t = transforms[transform_index];
  const int64_t V = 41;
  const Row r = MakeRow(V, 17 + transform_index, t, false);
  const double g_d = 0.7, g_ce = -0.3;
  // The row's values as the service computes them: 3 slices combined.
  double jsd = 0, kl_student = 0;
  const DivergenceRow row = Combined(r, 3, T, beta, &jsd, &kl_student);
  DivergenceGradRow g;
  g.lse_s = row.lse_s;
  g.lse_t = row.lse_t;
  g.aux = beta == 1 ? row.reverse_kl : kl_student;
  g.grad_divergence = g_d;
  g.grad_cross_entropy = g_ce;
  std::vector<float> dy = r.zs;
  DivergenceLogitGradients(t, T, beta, g, r.zt.data(), V, dy.data());
  // Central differences of the float64 loss in the GEMM output.
  std::vector<double> ys(r.ys.begin(), r.ys.end());
  const std::vector<double> xt = Xs(r.zt, T);
  double largest = 0;
  std::vector<double> fd(V);
  for (int64_t v = 0; v < V; ++v) {
    const double h = 1e-5;
    std::vector<double> up = ys, down = ys;
    up[v] += h;
    down[v] -= h;
    fd[v] = (Loss(up, xt, t, T, beta, g_d, g_ce) - Loss(down, xt, t, T, beta, g_d, g_ce)) / (2 * h);
    largest = std::max(largest, std::abs(fd[v]));
  }
  ASSERT_GT(largest, 1e-3);
  for (int64_t v = 0; v < V; ++v) EXPECT_NEAR(dy[v], fd[v], 1e-5 * largest + 1e-9) << "column " << v;
}

INSTANTIATE_TEST_SUITE_P(Kinds, DivergenceGradient,
                         ::testing::Combine(::testing::Values(0.0, 0.5, 1.0, 0.2), ::testing::Values(1.0f, 0.7f),
                                            ::testing::Values(0, 1, 2)));

TEST(DivergenceGradient, TokensThatEitherModelRulesOutGiveNoNaN) {
  const Row r = MakeRow(16, 5, LmHeadTransform{}, true);
  for (double beta : {0.0, 0.5}) {
    double jsd = 0, kl_student = 0;
    const DivergenceRow row = Combined(r, 2, 1.0f, beta, &jsd, &kl_student);
    DivergenceGradRow g;
    g.lse_s = row.lse_s;
    g.lse_t = row.lse_t;
    g.aux = kl_student;
    g.grad_divergence = 1.0;
    g.grad_cross_entropy = 0.5;
    std::vector<float> dy = r.zs;
    DivergenceLogitGradients(LmHeadTransform{}, 1.0f, beta, g, r.zt.data(), 16, dy.data());
    for (int64_t v = 0; v < 16; ++v) EXPECT_TRUE(std::isfinite(dy[v])) << "beta " << beta << " column " << v;
    EXPECT_EQ(dy[1], 0.0f);  // ruled out by both: no probability, no gradient
  }
}

}  // namespace
}  // namespace logprob::kernels
