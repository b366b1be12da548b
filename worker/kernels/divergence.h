// Full-vocabulary distillation divergences over one worker's vocabulary
// slice (issue 48): the student's and the teacher's transformed logits
// z_s, z_t of the same vocabulary columns give, per row and per slice,
// float64 partials that combine in rank order into the whole vocabulary's
//
//   lse_s, lse_t          log-normalisers of x_s = z_s / T, x_t = z_t / T
//   entropy_s             the student's entropy  lse_s - sum p_s x_s
//   forward KL (beta 0)   KL(p_t || p_s) = sum p_t (x_t - x_s) - lse_t + lse_s
//   reverse KL (beta 1)   KL(p_s || p_t) = sum p_s (x_s - x_t) - lse_s + lse_t
//   cross entropy         H(p_t, p_s) = lse_s - sum p_t x_s, the seeds' soft-
//                         target cross entropy (NeMo-RL DistributedCrossEntropy:
//                         the forward KL up to the teacher's entropy)
//
// in one collective round (each sum relative to its slice's maxima). The
// generalized JSD (0 < beta < 1, TRL 1.16 ChunkedDivergenceFunction: mixture
// m = (1 - beta) p_s + beta p_t, JSD = beta KL(p_t || m) + (1 - beta)
// KL(p_s || m)) needs both log-normalisers inside its sums, so a second
// round: per slice sum_v of beta p_t (log p_t - log m) + (1 - beta) p_s
// (log p_s - log m) and of KL(p_s || m)'s terms, summed in rank order.
//
// The student's gradient (TRL's backward): for an upstream dL/dD and dL/dCE,
//   dL/dx_s = g_D G + g_CE (p_s - p_t),  with G =
//     p_s - p_t                                  (forward KL)
//     p_s (log p_s - log p_t - KL(p_s || p_t))    (reverse KL)
//     (1 - beta) p_s (log p_s - log m - KL(p_s || m))  (JSD)
//   dL/dy_s = dL/dx_s / T * scale_s * (1 - (z_s / c_s)^2)  (softcap c_s only)
// element-wise from the row's combined values: no further collective.
// Terms with a zero probability are zero (a -inf logit contributes
// nothing), so a teacher that rules a token out is no NaN.
#pragma once

#include <cstdint>

#include "common/lm_head_transform.h"

namespace logprob::kernels {

/// Which divergence `beta` selects: 0 forward KL, 1 reverse KL, else JSD.
enum class DivergenceKind { kForwardKl, kReverseKl, kJsd };
DivergenceKind DivergenceKindOf(double beta);

/// One row's first-round partial over a slice (float64; plain data, so it
/// travels as bytes in a collective). Maxima -inf and sums 0 over an empty
/// slice.
struct DivergencePartial {
  double s_max, s_sum, s_x, s_gap;   // max x_s; sum e^(x_s - s_max) (1, x_s, x_s - x_t)
  double t_max, t_sum, t_gap, t_xs;  // max x_t; sum e^(x_t - t_max) (1, x_t - x_s, x_s)
};

/// The partial of columns [0, C) of one row: zs, zt [C] the transformed
/// logits (f32) of the student and the teacher, x = z / T rounded to
/// float32 once (as the logprob kernels). Thread-safe.
DivergencePartial SliceDivergencePartial(const float* zs, const float* zt, int64_t C, float temperature);

/// SliceDivergencePartial of m rows (zs, zt [m, C], out [m]), the rows
/// shared among OpenMP threads (each row's partial is its own: the same
/// bits whatever the team).
void SliceDivergencePartials(const float* zs, const float* zt, int64_t m, int64_t C, float temperature,
                             DivergencePartial* out);

/// A row's first-round values, the slices combined.
struct DivergenceRow {
  double lse_s = 0, lse_t = 0, entropy_s = 0, cross_entropy = 0, forward_kl = 0, reverse_kl = 0;
};
/// Combines the W partials of one row in rank order (parts[q]: rank q's).
DivergenceRow CombineDivergencePartials(const DivergencePartial* const* parts, int W);

/// One row's second-round (JSD) partial over a slice.
struct JsdPartial {
  double jsd = 0, kl_student = 0;  // sums of beta p_t log(p_t/m) + (1-beta) p_s log(p_s/m), and of p_s log(p_s/m)
};
/// The JSD partial of columns [0, C) of one row, from its combined
/// lse_s / lse_t; 0 < beta < 1. Thread-safe.
JsdPartial SliceJsdPartial(const float* zs, const float* zt, int64_t C, float temperature, double beta, double lse_s,
                           double lse_t);

/// What a row's student gradient needs.
struct DivergenceGradRow {
  double lse_s = 0, lse_t = 0;
  double aux = 0;                 // forward KL: unused; reverse KL: KL(p_s || p_t); JSD: KL(p_s || m)
  double grad_divergence = 0;     // dL/dD
  double grad_cross_entropy = 0;  // dL/dCE
};
/// SliceJsdPartial of m rows (lse_s, lse_t, out [m]), rows shared among
/// OpenMP threads.
void SliceJsdPartials(const float* zs, const float* zt, int64_t m, int64_t C, float temperature, double beta,
                      const double* lse_s, const double* lse_t, JsdPartial* out);

/// In place over zs [C] (the student's transformed logits of one row):
/// dL/dy_s, the gradient of the student's GEMM output (header comment),
/// float64 per element, rounded once. `student`: its scale and softcap;
/// zt [C] the teacher's transformed logits. Thread-safe on distinct rows.
void DivergenceLogitGradients(const LmHeadTransform& student, float temperature, double beta,
                              const DivergenceGradRow& row, const float* zt, int64_t C, float* zs);

/// DivergenceLogitGradients of m rows (rows [m], zt and zs [m, C]), rows
/// shared among OpenMP threads.
void DivergenceLogitGradientsRows(const LmHeadTransform& student, float temperature, double beta,
                                  const DivergenceGradRow* rows, const float* zt, int64_t m, int64_t C, float* zs);

}  // namespace logprob::kernels
