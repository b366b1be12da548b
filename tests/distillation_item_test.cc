// One worker group's distillation work item (worker/gradients/
// distillation_item.h), W ranks as threads over the in-process
// communicator, each with its CPU backend's slices SplitRange(V, W, rank)
// of a student head and a teacher head of other hidden sizes
// (tests/distillation_reference.h): every rank's rows' divergence, cross
// entropy, student entropy and dL/dh, and its gradient step's dL/dW,
// dL/db of the student's slice, within the float64 reference's tolerance;
// a row's outputs and dL/dh bitwise the same with other rows around it and
// other rounds; inconsistent items refused on every rank before any
// collective, never a hang.
#include "worker/gradients/distillation_item.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/partition.h"
#include "tests/distillation_reference.h"
#include "tests/head_backward_reference.h"
#include "tests/in_process_communicator.h"
#include "worker/scoring/cpu_backend.h"

namespace logprob::testing {
namespace {

using distillation_reference::Case;
using distillation_reference::Hs;
using distillation_reference::Ht;
using distillation_reference::kCases;
using distillation_reference::Make;
using distillation_reference::N;
using distillation_reference::Problem;
using distillation_reference::V;
using internal::v1::WorkItem;
using internal::v1::WorkResult;
using kernels::backward_reference::WithinRowTolerance;

constexpr int64_t kChunk = 6;  // --hidden-chunk-tokens: several rounds
constexpr char kStep[] = "distill/step-1";

struct ItemSpec {
  int64_t begin = 0, end = N;
  bool backward = true;
  std::string step = kStep;
};

/// Rank r's item of W, as the front-end would build it.
WorkItem ItemFor(const Case& c, const Problem& p, const ItemSpec& spec, int W, int r) {
  const int64_t n = spec.end - spec.begin;
  WorkItem item;
  item.set_layout(internal::v1::HIDDEN_STATES);
  item.set_dtype(v1::F32);
  item.set_vocab_size(V);
  item.set_hidden_size(Hs);
  const auto [vb, ve] = SplitRange(V, W, r);
  item.set_vocab_begin(vb);
  item.set_vocab_end(ve);
  item.set_num_rows(n);
  item.mutable_lm_head()->set_name("student");
  item.mutable_lm_head()->set_version("v1");
  item.mutable_options()->set_temperature(c.temperature);
  if (spec.backward && !spec.step.empty()) item.mutable_options()->set_gradient_step(spec.step);
  item.set_backward(spec.backward);
  auto* d = item.mutable_distillation();
  d->mutable_teacher()->set_name("teacher");
  d->mutable_teacher()->set_version("t1");
  d->set_teacher_hidden_size(Ht);
  d->set_teacher_dtype(v1::F32);
  d->set_beta(c.beta);
  if (spec.backward)
    for (int64_t i = spec.begin; i < spec.end; ++i) {
      d->add_grad_divergence(p.g_d[i]);
      d->add_grad_cross_entropy(p.g_ce[i]);
    }
  const auto [rb, re] = SplitRange(n, W, r);
  item.set_data(reinterpret_cast<const char*>(p.hs.data() + (spec.begin + rb) * Hs), (re - rb) * Hs * sizeof(float));
  d->set_teacher_data(reinterpret_cast<const char*>(p.ht.data() + (spec.begin + rb) * Ht),
                      (re - rb) * Ht * sizeof(float));
  return item;
}

/// Rank r's CPU backend with its slices of both heads (f32 GEMMs).
struct RankHeads {
  std::unique_ptr<CpuBackend> backend = std::make_unique<CpuBackend>(/*threads=*/1);
  std::shared_ptr<const LmHeadWeights> student, teacher;
};
std::shared_ptr<const LmHeadWeights> Load(CpuBackend& backend, const std::vector<float>& w, const std::vector<float>& b,
                                          int64_t H, const LmHeadTransform& t, int64_t vb, int64_t ve) {
  std::vector<char> bytes(reinterpret_cast<const char*>(w.data() + vb * H),
                          reinterpret_cast<const char*>(w.data() + ve * H));
  std::vector<float> bias;
  if (t.has_bias) bias.assign(b.begin() + vb, b.begin() + ve);
  auto loaded = backend.LoadLmHead(LmHeadSlice{v1::F32, std::move(bytes), ve - vb, H, t, std::move(bias)},
                                   LmHeadPrecision::kFp32);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return loaded.ok() ? *std::move(loaded) : nullptr;
}
RankHeads HeadsFor(const Case& c, const Problem& p, int W, int r) {
  RankHeads h;
  const auto [vb, ve] = SplitRange(V, W, r);
  h.student = Load(*h.backend, p.ws, p.bs, Hs, c.student, vb, ve);
  h.teacher = Load(*h.backend, p.wt, p.bt, Ht, c.teacher, vb, ve);
  return h;
}

std::vector<std::unique_ptr<HeadGradientSteps>> Steps(int W) {
  std::vector<std::unique_ptr<HeadGradientSteps>> steps;
  for (int r = 0; r < W; ++r)
    steps.push_back(
        std::make_unique<HeadGradientSteps>(HeadGradientSteps::Options{int64_t{1} << 24, absl::Minutes(10)}));
  return steps;
}

/// Runs rank r's items[r] on W threads; the group is not aborted when a
/// rank fails (the ranks must agree by themselves; a rank left waiting
/// fails after the group's timeout instead of hanging the test).
std::vector<absl::StatusOr<WorkResult>> RunRanks(const Case& c, const Problem& p, const std::vector<WorkItem>& items,
                                                 std::vector<std::unique_ptr<HeadGradientSteps>>* steps,
                                                 int64_t chunk = kChunk, bool drop_teacher = false) {
  const int W = static_cast<int>(items.size());
  InProcessGroup group(W, std::chrono::seconds(30));
  std::vector<absl::StatusOr<WorkResult>> results(W, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      RankHeads heads = HeadsFor(c, p, W, r);
      InProcessCommunicator comm(group, r);
      results[r] = RunDistillationItem(items[r], ItemPayload(items[r].data()), comm, *heads.backend, chunk, {},
                                       heads.student.get(), drop_teacher && r == W - 1 ? nullptr : heads.teacher.get(),
                                       *(*steps)[r]);
    });
  for (auto& t : threads) t.join();
  return results;
}

std::vector<WorkItem> Items(const Case& c, const Problem& p, const ItemSpec& spec, int W) {
  std::vector<WorkItem> items;
  for (int r = 0; r < W; ++r) items.push_back(ItemFor(c, p, spec, W, r));
  return items;
}

/// Every row's outputs of an item, gathered from the ranks' results.
struct Rows {
  std::vector<float> d, ce, ent, dh;
};
Rows Gather(const std::vector<absl::StatusOr<WorkResult>>& results, int64_t n, bool backward) {
  const int W = static_cast<int>(results.size());
  Rows out;
  out.d.assign(n, NAN);
  out.ce.assign(n, NAN);
  out.ent.assign(n, NAN);
  out.dh.assign(n * Hs, NAN);
  for (int r = 0; r < W; ++r) {
    if (!results[r].ok()) {
      ADD_FAILURE() << "rank " << r << ": " << results[r].status();
      continue;
    }
    const WorkResult& res = *results[r];
    const auto [b, e] = SplitRange(n, W, r);
    EXPECT_EQ(res.row_begin(), b);
    EXPECT_EQ(res.divergence_size(), e - b);
    EXPECT_EQ(res.grad_hidden_states_size(), backward ? (e - b) * Hs : 0);
    if (res.divergence_size() != e - b || res.cross_entropy_size() != e - b || res.entropy_size() != e - b) continue;
    for (int64_t i = b; i < e; ++i) {
      out.d[i] = res.divergence(static_cast<int>(i - b));
      out.ce[i] = res.cross_entropy(static_cast<int>(i - b));
      out.ent[i] = res.entropy(static_cast<int>(i - b));
    }
    if (backward && e > b && res.grad_hidden_states_size() == (e - b) * Hs)
      std::memcpy(out.dh.data() + b * Hs, res.grad_hidden_states().data(), (e - b) * Hs * sizeof(float));
  }
  return out;
}

class DistillationItem : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DistillationItem, OutputsDhAndTheStepsSumsMatchFloat64) {
  const auto [case_index, W] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 300 + case_index);
  auto steps = Steps(W);
  const auto results = RunRanks(c, p, Items(c, p, ItemSpec{}, W), &steps);
  const Rows got = Gather(results, N, true);
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_NEAR(got.d[i], p.d[i], 1e-5 * std::max(1.0, std::abs(p.d[i]))) << "divergence row " << i;
    EXPECT_NEAR(got.ce[i], p.ce[i], 1e-5 * std::max(1.0, std::abs(p.ce[i]))) << "cross entropy row " << i;
    EXPECT_NEAR(got.ent[i], p.ent[i], 1e-5 * std::max(1.0, std::abs(p.ent[i]))) << "entropy row " << i;
  }
  EXPECT_EQ(WithinRowTolerance(got.dh, p.dh, N, Hs, "dL/dh"), "");
  // The student's slices' sums, read back from each rank's step.
  std::vector<float> dw(V * Hs, NAN), db(V, NAN);
  for (int r = 0; r < W; ++r) {
    const auto [vb, ve] = SplitRange(V, W, r);
    auto sums = steps[r]->Read(kStep, 0, ve - vb);
    ASSERT_TRUE(sums.ok()) << "rank " << r << ": " << sums.status();
    EXPECT_EQ(sums->head, "student");
    ASSERT_EQ(static_cast<int64_t>(sums->weight.size()), (ve - vb) * Hs);
    std::copy(sums->weight.begin(), sums->weight.end(), dw.begin() + vb * Hs);
    if (c.student.has_bias) {
      ASSERT_EQ(static_cast<int64_t>(sums->bias.size()), ve - vb);
      std::copy(sums->bias.begin(), sums->bias.end(), db.begin() + vb);
    }
  }
  EXPECT_EQ(WithinRowTolerance(dw, p.dw, V, Hs, "dL/dW"), "");
  if (c.student.has_bias) {
    EXPECT_EQ(WithinRowTolerance(db, p.db, 1, V, "dL/db"), "");
  }
}

TEST_P(DistillationItem, ARowsOutputsAndDhAreTheSameWithOtherRowsAndRounds) {
  const auto [case_index, W] = GetParam();
  const Case& c = kCases[case_index];
  const Problem p = Make(c, 400 + case_index);
  auto steps = Steps(W);
  const Rows all = Gather(RunRanks(c, p, Items(c, p, ItemSpec{0, N, true, ""}, W), &steps), N, true);
  const Rows some = Gather(RunRanks(c, p, Items(c, p, ItemSpec{9, 31, true, ""}, W), &steps, 4), 22, true);
  const Rows forward = Gather(RunRanks(c, p, Items(c, p, ItemSpec{9, 31, false, ""}, W), &steps), 22, false);
  for (int64_t i = 9; i < 31; ++i) {
    EXPECT_EQ(std::memcmp(&some.d[i - 9], &all.d[i], 4), 0) << "row " << i;
    EXPECT_EQ(std::memcmp(&forward.d[i - 9], &all.d[i], 4), 0) << "row " << i;
    EXPECT_EQ(std::memcmp(&forward.ce[i - 9], &all.ce[i], 4), 0) << "row " << i;
    EXPECT_EQ(std::memcmp(some.dh.data() + (i - 9) * Hs, all.dh.data() + i * Hs, Hs * 4), 0) << "row " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DistillationItem, ::testing::Combine(::testing::Range(0, 4), ::testing::Values(1, 3)));

TEST(DistillationItemErrors, InconsistentItemsAreRefusedOnEveryRankWithoutAHang) {
  const Case& c = kCases[1];
  const Problem p = Make(c, 500);
  const int W = 3;
  struct Bad {
    const char* what;
    std::function<void(WorkItem&)> edit;
    absl::StatusCode code;
  };
  const Bad bad[] = {
      {"beta", [](WorkItem& i) { i.mutable_distillation()->set_beta(1.5); }, absl::StatusCode::kInvalidArgument},
      {"grad_divergence",
       [](WorkItem& i) { i.mutable_distillation()->set_grad_divergence(3, std::numeric_limits<float>::infinity()); },
       absl::StatusCode::kInvalidArgument},
      {"teacher_data", [](WorkItem& i) { i.mutable_distillation()->mutable_teacher_data()->pop_back(); },
       absl::StatusCode::kInvalidArgument},
      {"teacher_hidden_size", [](WorkItem& i) { i.mutable_distillation()->set_teacher_hidden_size(Hs); },
       absl::StatusCode::kInvalidArgument},
  };
  for (const Bad& b : bad) {
    std::vector<WorkItem> items = Items(c, p, ItemSpec{}, W);
    for (auto& item : items) b.edit(item);
    auto steps = Steps(W);
    const auto results = RunRanks(c, p, items, &steps);
    for (int r = 0; r < W; ++r) {
      ASSERT_FALSE(results[r].ok()) << b.what << ", rank " << r;
      EXPECT_EQ(results[r].status().code(), b.code) << b.what << ", rank " << r << ": " << results[r].status();
      EXPECT_NE(results[r].status().message().find(b.what), std::string::npos) << results[r].status();
    }
    EXPECT_EQ(steps[0]->open_steps(), 0u) << b.what;
  }
}

}  // namespace
}  // namespace logprob::testing
