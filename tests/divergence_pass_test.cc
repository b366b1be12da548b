// Full-vocabulary distillation over W ranks (worker/scoring/divergence_
// pass.h) as threads over the in-process communicator, each with its slice
// of a student head (bias, scale or softcap; hidden size 48) and of a
// teacher head (softcap or scale; hidden size 64): the divergence (forward
// KL, JSD, reverse KL), the soft-target cross entropy and the student's
// entropy against float64, and the student's dL/dh (the ranks' shares
// summed in rank order), dL/dW and dL/db within 1e-4 of each row's largest
// float64 element plus 1e-7; a row's outputs and dL/dh bitwise the same
// alone or in a batch, whatever the rounds.
#include "worker/scoring/divergence_pass.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/host_bytes.h"
#include "common/status_macros.h"
#include "tests/distillation_reference.h"
#include "tests/head_backward_reference.h"
#include "tests/in_process_communicator.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scoring/cpu_slice_distillation.h"

namespace logprob {
namespace {

using distillation_reference::Case;
using distillation_reference::Hs;
using distillation_reference::Ht;
using distillation_reference::kCases;
using distillation_reference::Make;
using distillation_reference::N;
using distillation_reference::Problem;
using distillation_reference::V;

struct Got {
  std::vector<float> d, ce, ent, dh, dw, db;
};

HostBytes Bytes(const float* data, int64_t n) {
  return HostBytes(std::vector<char>(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data + n)));
}

/// Rows [row_begin, row_begin + rows) of `p` through W ranks.
Got Pass(const Case& c, const Problem& p, int W, int64_t row_begin, int64_t rows, int64_t round_rows) {
  Got out;
  out.d.assign(rows, 0.f);
  out.ce.assign(rows, 0.f);
  out.ent.assign(rows, 0.f);
  out.dh.assign(rows * Hs, 0.f);
  out.dw.assign(V * Hs, 0.f);
  out.db.assign(V, 0.f);
  std::vector<std::vector<float>> shares(W, std::vector<float>(rows * Hs));
  std::vector<Got> per_rank(W, out);
  std::vector<absl::Status> status(W);
  testing::InProcessGroup group(W);
  std::vector<std::thread> ranks;
  for (int r = 0; r < W; ++r)
    ranks.emplace_back([&, r] {
      const int64_t vb = V * r / W, ve = V * (r + 1) / W;
      status[r] = [&]() -> absl::Status {
        LOGPROB_ASSIGN_OR_RETURN(
            auto sg, kernels::LmHeadGemm::Create(v1::F32, Bytes(p.ws.data() + vb * Hs, (ve - vb) * Hs), ve - vb, Hs, 1,
                                                 LmHeadPrecision::kFp32));
        LOGPROB_ASSIGN_OR_RETURN(
            auto tg, kernels::LmHeadGemm::Create(v1::F32, Bytes(p.wt.data() + vb * Ht, (ve - vb) * Ht), ve - vb, Ht, 1,
                                                 LmHeadPrecision::kFp32));
        LOGPROB_ASSIGN_OR_RETURN(
            auto student, kernels::HeadSliceBackward::Create(sg.get(), vb, p.bs.data() + vb, c.student, c.temperature));
        TeacherSlice teacher{tg.get(), c.teacher, p.bt.data() + vb};
        LOGPROB_ASSIGN_OR_RETURN(auto slice, CpuSliceDistillation::Create(std::move(student), teacher));
        testing::InProcessCommunicator comm(group, r);
        DivergencePassRows in;
        in.student_hidden = p.hs.data() + row_begin * Hs;
        in.teacher_hidden = p.ht.data() + row_begin * Ht;
        in.rows = rows;
        in.beta = c.beta;
        in.temperature = c.temperature;
        in.grad_divergence = p.g_d.data() + row_begin;
        in.grad_cross_entropy = p.g_ce.data() + row_begin;
        in.backward = true;
        in.round_rows = round_rows;
        Got& mine = per_rank[r];
        DivergencePassOutputs o{mine.d.data(), mine.ce.data(), mine.ent.data()};
        LOGPROB_RETURN_IF_ERROR(RunDivergencePass(in, *slice, comm, o, shares[r].data(), out.dw.data() + vb * Hs,
                                                  c.student.has_bias ? out.db.data() + vb : nullptr));
        return slice->Flush(out.dw.data() + vb * Hs, out.db.data() + vb);
      }();
      if (!status[r].ok()) group.Abort();
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < W; ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    for (int64_t k = 0; k < rows * Hs; ++k) out.dh[k] += shares[r][k];  // rank order
    // Every rank answers the same values.
    EXPECT_EQ(std::memcmp(per_rank[r].d.data(), per_rank[0].d.data(), rows * 4), 0) << "rank " << r;
  }
  out.d = per_rank[0].d;
  out.ce = per_rank[0].ce;
  out.ent = per_rank[0].ent;
  return out;
}

class DivergencePass : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DivergencePass, ValuesAndStudentGradientsMatchFloat64) {
  const auto [case_index, workers] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 100 + case_index);
  const Got g = Pass(c, p, workers, 0, N, 16);  // three rounds, the last partial
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_NEAR(g.d[i], p.d[i], 1e-5 * std::max(1.0, std::abs(p.d[i]))) << "divergence row " << i;
    EXPECT_NEAR(g.ce[i], p.ce[i], 1e-5 * std::max(1.0, std::abs(p.ce[i]))) << "cross entropy row " << i;
    EXPECT_NEAR(g.ent[i], p.ent[i], 1e-5 * std::max(1.0, std::abs(p.ent[i]))) << "entropy row " << i;
  }
  using kernels::backward_reference::WithinRowTolerance;
  EXPECT_EQ(WithinRowTolerance(g.dh, p.dh, N, Hs, "dL/dh"), "");
  EXPECT_EQ(WithinRowTolerance(g.dw, p.dw, V, Hs, "dL/dW"), "");
  if (c.student.has_bias) {
    EXPECT_EQ(WithinRowTolerance(g.db, p.db, 1, V, "dL/db"), "");
  }
}

TEST_P(DivergencePass, ARowsValuesAndGradientAreTheSameAloneOrInABatch) {
  const auto [case_index, workers] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 200 + case_index);
  const Got all = Pass(c, p, workers, 0, N, 16);
  const Got alone = Pass(c, p, workers, 17, 1, 16);
  const Got other_rounds = Pass(c, p, workers, 3, N - 3, 5);
  EXPECT_EQ(std::memcmp(alone.dh.data(), all.dh.data() + 17 * Hs, Hs * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(other_rounds.dh.data() + 14 * Hs, all.dh.data() + 17 * Hs, Hs * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(&alone.d[0], &all.d[17], 4), 0);
  EXPECT_EQ(std::memcmp(&other_rounds.d[14], &all.d[17], 4), 0);
  EXPECT_EQ(std::memcmp(&other_rounds.ce[14], &all.ce[17], 4), 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, DivergencePass, ::testing::Combine(::testing::Range(0, 4), ::testing::Values(1, 3)));

TEST(DivergencePassErrors, BadBetaTemperatureAndRowsAreRefused) {
  std::vector<float> w(V * Hs, 0.1f), wt(V * Ht, 0.1f);
  auto sg = kernels::LmHeadGemm::Create(v1::F32, Bytes(w.data(), V * Hs), V, Hs);
  auto tg = kernels::LmHeadGemm::Create(v1::F32, Bytes(wt.data(), V * Ht), V, Ht);
  ASSERT_TRUE(sg.ok() && tg.ok());
  auto student = kernels::HeadSliceBackward::Create(sg->get(), 0, nullptr, LmHeadTransform{}, 1.0f);
  ASSERT_TRUE(student.ok());
  auto slice = CpuSliceDistillation::Create(std::move(*student), TeacherSlice{tg->get(), {}, nullptr});
  ASSERT_TRUE(slice.ok());
  testing::InProcessGroup group(1);
  testing::InProcessCommunicator comm(group, 0);
  std::vector<float> hs(Hs), ht(Ht), dh(Hs);
  DivergencePassRows in;
  in.student_hidden = hs.data();
  in.teacher_hidden = ht.data();
  in.rows = 1;
  for (double beta : {-0.1, 1.5, std::nan("")}) {
    in.beta = beta;
    EXPECT_EQ(RunDivergencePass(in, **slice, comm, {}, dh.data(), nullptr, nullptr).code(),
              absl::StatusCode::kInvalidArgument)
        << beta;
  }
  in.beta = 0.5;
  in.temperature = 0.0f;
  EXPECT_EQ(RunDivergencePass(in, **slice, comm, {}, dh.data(), nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  in.temperature = 1.0f;
  in.teacher_hidden = nullptr;
  EXPECT_EQ(RunDivergencePass(in, **slice, comm, {}, dh.data(), nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  // A teacher slice of other vocabulary rows.
  auto tg2 = kernels::LmHeadGemm::Create(v1::F32, Bytes(wt.data(), (V - 1) * Ht), V - 1, Ht);
  ASSERT_TRUE(tg2.ok());
  auto student2 = kernels::HeadSliceBackward::Create(sg->get(), 0, nullptr, LmHeadTransform{}, 1.0f);
  ASSERT_TRUE(student2.ok());
  EXPECT_EQ(CpuSliceDistillation::Create(std::move(*student2), TeacherSlice{tg2->get(), {}, nullptr}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace logprob
