#include "worker/scoring/divergence_pass.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace logprob {

absl::Status RunDivergencePass(const DivergencePassRows& in, SliceDistillation& slice, Communicator& comm,
                               const DivergencePassOutputs& out, float* grad_hidden, float* grad_weight,
                               float* grad_bias) {
  if (in.rows < 0 || in.round_rows <= 0)
    return absl::InvalidArgumentError(absl::StrCat("distillation: rows ", in.rows, ", round_rows ", in.round_rows));
  if (!(in.beta >= 0.0 && in.beta <= 1.0))
    return absl::InvalidArgumentError(absl::StrCat("distillation: beta must be in [0, 1], got ", in.beta));
  if (!(in.temperature > 0.0f))
    return absl::InvalidArgumentError(absl::StrCat("distillation: temperature must be > 0, got ", in.temperature));
  if (in.rows > 0 &&
      (in.student_hidden == nullptr || in.teacher_hidden == nullptr || (in.backward && grad_hidden == nullptr)))
    return absl::InvalidArgumentError("distillation: null hidden states or dL/dh buffer");
  const int W = comm.size();
  const kernels::DivergenceKind kind = kernels::DivergenceKindOf(in.beta);
  const int64_t Hs = slice.student_hidden_size(), Ht = slice.teacher_hidden_size();
  const size_t s_row = static_cast<size_t>(Hs) * DTypeSize(in.student_dtype);
  const size_t t_row = static_cast<size_t>(Ht) * DTypeSize(in.teacher_dtype);
  std::vector<kernels::DivergencePartial> mine, all;
  std::vector<kernels::JsdPartial> jsd_mine, jsd_all;
  std::vector<const kernels::DivergencePartial*> ranks(static_cast<size_t>(W));
  std::vector<kernels::DivergenceRow> combined;
  std::vector<double> lse_s, lse_t, jsd, kl_student;
  std::vector<kernels::DivergenceGradRow> grad_rows;
  for (int64_t r0 = 0; r0 < in.rows; r0 += in.round_rows) {
    const int64_t m = std::min(in.round_rows, in.rows - r0);
    DistillationRound round;
    round.student_dtype = in.student_dtype;
    round.student_hidden = static_cast<const char*>(in.student_hidden) + r0 * s_row;
    round.teacher_dtype = in.teacher_dtype;
    round.teacher_hidden = static_cast<const char*>(in.teacher_hidden) + r0 * t_row;
    round.m = m;
    // 1. Both models' partials on this slice; every slice's to every worker.
    mine.resize(static_cast<size_t>(m));
    LOGPROB_RETURN_IF_ERROR(slice.Partials(round, in.temperature, mine.data()));
    all.resize(mine.size() * static_cast<size_t>(W));
    LOGPROB_RETURN_IF_ERROR(comm.AllGather(mine.data(), mine.size() * sizeof(kernels::DivergencePartial), all.data()));
    combined.resize(static_cast<size_t>(m));
    lse_s.resize(static_cast<size_t>(m));
    lse_t.resize(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) {
      for (int q = 0; q < W; ++q) ranks[q] = &all[static_cast<size_t>(q * m + i)];
      combined[i] = kernels::CombineDivergencePartials(ranks.data(), W);
      lse_s[i] = combined[i].lse_s;
      lse_t[i] = combined[i].lse_t;
    }
    // 2. The JSD's second round, from both log-normalisers.
    jsd.assign(static_cast<size_t>(m), 0.0);
    kl_student.assign(static_cast<size_t>(m), 0.0);
    if (kind == kernels::DivergenceKind::kJsd) {
      jsd_mine.resize(static_cast<size_t>(m));
      LOGPROB_RETURN_IF_ERROR(slice.JsdPartials(in.temperature, in.beta, lse_s.data(), lse_t.data(), jsd_mine.data()));
      jsd_all.resize(jsd_mine.size() * static_cast<size_t>(W));
      LOGPROB_RETURN_IF_ERROR(
          comm.AllGather(jsd_mine.data(), jsd_mine.size() * sizeof(kernels::JsdPartial), jsd_all.data()));
      for (int64_t i = 0; i < m; ++i)
        for (int q = 0; q < W; ++q) {  // rank order
          jsd[i] += jsd_all[static_cast<size_t>(q * m + i)].jsd;
          kl_student[i] += jsd_all[static_cast<size_t>(q * m + i)].kl_student;
        }
    }
    for (int64_t i = 0; i < m; ++i) {
      const kernels::DivergenceRow& c = combined[i];
      const double d = kind == kernels::DivergenceKind::kForwardKl   ? c.forward_kl
                       : kind == kernels::DivergenceKind::kReverseKl ? c.reverse_kl
                                                                     : jsd[i];
      if (out.divergence) out.divergence[r0 + i] = static_cast<float>(d);
      if (out.cross_entropy) out.cross_entropy[r0 + i] = static_cast<float>(c.cross_entropy);
      if (out.entropy) out.entropy[r0 + i] = static_cast<float>(c.entropy_s);
    }
    if (!in.backward) continue;
    // 3. The student's gradients on this slice.
    grad_rows.resize(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) {
      kernels::DivergenceGradRow& g = grad_rows[i];
      g.lse_s = lse_s[i];
      g.lse_t = lse_t[i];
      g.aux = kind == kernels::DivergenceKind::kReverseKl ? combined[i].reverse_kl : kl_student[i];
      g.grad_divergence = in.grad_divergence ? in.grad_divergence[r0 + i] : 0.0;
      g.grad_cross_entropy = in.grad_cross_entropy ? in.grad_cross_entropy[r0 + i] : 0.0;
    }
    LOGPROB_RETURN_IF_ERROR(
        slice.Gradients(in.temperature, in.beta, grad_rows.data(), grad_hidden + r0 * Hs, grad_weight, grad_bias));
  }
  return absl::OkStatus();
}

}  // namespace logprob
