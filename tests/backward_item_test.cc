// One worker group's backward work item (worker/gradients/backward_item.h),
// W ranks as threads over the in-process communicator, each with its CPU
// backend's slice SplitRange(V, W, rank) of a random head (bias, scale,
// softcap; temperature 0.7): every rank's dL/dh rows and its HeadGradientSteps
// sums of its slice within 1e-4 of each row's largest float64 element plus
// 1e-7 of the float64 reference (tests/head_backward_reference.h); the
// forward's token logprobs and entropy bit for bit; micro-batches add up; a
// row's dL/dh is bitwise the same with other rows around it; a gradient
// step that one rank refuses fails the item on every rank, adds nothing and
// never hangs; inconsistent items are refused before any collective.
#include "worker/gradients/backward_item.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/partition.h"
#include "tests/head_backward_reference.h"
#include "tests/in_process_communicator.h"
#include "worker/scoring/cpu_backend.h"
#include "worker/scoring/scorer.h"

namespace logprob::testing {
namespace {

using internal::v1::WorkItem;
using internal::v1::WorkResult;
using kernels::backward_reference::Case;
using kernels::backward_reference::H;
using kernels::backward_reference::Make;
using kernels::backward_reference::N;
using kernels::backward_reference::Problem;
using kernels::backward_reference::V;
using kernels::backward_reference::WithinRowTolerance;

/// F32 weights with a bias, logit scale 1.5 and softcap 5; temperature 0.7.
const Case kCase{v1::F32, LmHeadTransform{true, 1.5, 5.0}, 0.7f};
constexpr int64_t kChunk = 5;  // --hidden-chunk-tokens: several rounds
constexpr char kStep[] = "run-1/step-1";

/// What an item is made of: rows [begin, end) of the problem, the options
/// and whether it is a backward (false: the forward of the same rows).
struct ItemSpec {
  int64_t begin = 0, end = N;
  bool backward = true;
  bool grad_entropy = true;
  std::string step;  // options.gradient_step
};

/// Rank r's item of W for `spec`, as the front-end's planner builds it:
/// every row's targets and upstream gradients, the hidden states of the
/// rank's rows SplitRange(n, W, r), its vocabulary slice.
WorkItem ItemFor(const Problem& p, const ItemSpec& spec, int W, int r) {
  const int64_t n = spec.end - spec.begin;
  WorkItem item;
  item.set_layout(internal::v1::HIDDEN_STATES);
  item.set_dtype(v1::F32);
  item.set_vocab_size(V);
  item.set_hidden_size(H);
  const auto [vb, ve] = SplitRange(V, W, r);
  item.set_vocab_begin(vb);
  item.set_vocab_end(ve);
  item.set_num_rows(n);
  item.mutable_lm_head()->set_name("policy");
  item.mutable_lm_head()->set_version("v1");
  item.mutable_options()->set_temperature(kCase.temperature);
  item.mutable_options()->set_entropy(true);
  if (!spec.step.empty()) item.mutable_options()->set_gradient_step(spec.step);
  for (int64_t i = spec.begin; i < spec.end; ++i) {
    item.add_targets(p.targets[i]);
    if (spec.backward) {
      item.add_grad_token_logprobs(p.g_lp[i]);
      if (spec.grad_entropy) item.add_grad_entropy(p.g_ent[i]);
    }
  }
  item.set_backward(spec.backward);
  const auto [rb, re] = SplitRange(n, W, r);
  item.set_data(reinterpret_cast<const char*>(p.h.data() + (spec.begin + rb) * H), (re - rb) * H * sizeof(float));
  return item;
}

/// Rank r's CPU backend and its lm_head slice SplitRange(V, W, r) (f32 GEMM).
struct RankHead {
  std::unique_ptr<CpuBackend> backend = std::make_unique<CpuBackend>(/*threads=*/1);
  std::shared_ptr<const LmHeadWeights> lm_head;
};
RankHead HeadFor(const Problem& p, int W, int r) {
  RankHead h;
  const auto [vb, ve] = SplitRange(V, W, r);
  std::vector<char> w(p.w_bytes.begin() + vb * H * 4, p.w_bytes.begin() + ve * H * 4);
  std::vector<float> bias(p.bias.begin() + vb, p.bias.begin() + ve);
  auto loaded = h.backend->LoadLmHead(LmHeadSlice{v1::F32, std::move(w), ve - vb, H, kCase.transform, std::move(bias)},
                                      LmHeadPrecision::kFp32);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  if (loaded.ok()) h.lm_head = *std::move(loaded);
  return h;
}

/// Every rank's HeadGradientSteps (a worker's, one per process).
std::vector<std::unique_ptr<HeadGradientSteps>> Steps(int W, int64_t max_bytes = int64_t{1} << 24) {
  std::vector<std::unique_ptr<HeadGradientSteps>> steps;
  for (int r = 0; r < W; ++r)
    steps.push_back(std::make_unique<HeadGradientSteps>(HeadGradientSteps::Options{max_bytes, absl::Minutes(10)}));
  return steps;
}

/// Runs rank r's `items[r]` (forward: ScoreWorkItem; backward:
/// RunBackwardItem with `steps[r]`, fresh ones when null) on W threads.
/// The group is not aborted when a rank fails: the ranks must agree by
/// themselves, and a rank left waiting fails with DEADLINE_EXCEEDED after
/// the group's timeout instead of hanging the test.
std::vector<absl::StatusOr<WorkResult>> RunRanks(const Problem& p, const std::vector<WorkItem>& items,
                                                 std::vector<std::unique_ptr<HeadGradientSteps>>* steps,
                                                 int64_t chunk = kChunk,
                                                 const std::function<bool(int rank)>& should_stop = {}) {
  const int W = static_cast<int>(items.size());
  std::vector<std::unique_ptr<HeadGradientSteps>> own_steps;
  if (steps == nullptr) {
    own_steps = Steps(W);
    steps = &own_steps;
  }
  InProcessGroup group(W, std::chrono::seconds(30));
  std::vector<absl::StatusOr<WorkResult>> results(W, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      RankHead head = HeadFor(p, W, r);
      InProcessCommunicator comm(group, r);
      std::function<bool()> stop;
      if (should_stop) stop = [&should_stop, r] { return should_stop(r); };
      const WorkItem& item = items[r];
      if (item.backward()) {
        results[r] = RunBackwardItem(item, ItemPayload(item.data()), comm, *head.backend, chunk, stop,
                                     head.lm_head.get(), *(*steps)[r]);
      } else {
        results[r] =
            ScoreWorkItem(item, ItemPayload(item.data()), comm, *head.backend, chunk, stop, head.lm_head.get());
      }
    });
  for (auto& t : threads) t.join();
  return results;
}

std::vector<WorkItem> Items(const Problem& p, const ItemSpec& spec, int W) {
  std::vector<WorkItem> items;
  for (int r = 0; r < W; ++r) items.push_back(ItemFor(p, spec, W, r));
  return items;
}

/// Every row's outputs of an item, gathered from the ranks' results (rows
/// of the item, 0-based).
struct Rows {
  std::vector<float> dh, token, entropy;
};
Rows Gather(const std::vector<absl::StatusOr<WorkResult>>& results, int64_t n, bool backward) {
  const int W = static_cast<int>(results.size());
  Rows out;
  out.dh.assign(n * H, NAN);
  out.token.assign(n, NAN);
  out.entropy.assign(n, NAN);
  for (int r = 0; r < W; ++r) {
    if (!results[r].ok()) {
      ADD_FAILURE() << "rank " << r << ": " << results[r].status();
      continue;
    }
    const WorkResult& res = *results[r];
    const auto [b, e] = SplitRange(n, W, r);
    EXPECT_EQ(res.row_begin(), b) << "rank " << r;
    EXPECT_EQ(res.row_end(), e) << "rank " << r;
    EXPECT_EQ(res.token_logprobs_size(), e - b) << "rank " << r;
    EXPECT_EQ(res.entropy_size(), e - b) << "rank " << r;
    EXPECT_EQ(res.grad_hidden_states_size(), backward ? (e - b) * H : 0) << "rank " << r;
    if (res.token_logprobs_size() != e - b || res.entropy_size() != e - b) continue;
    for (int64_t i = b; i < e; ++i) {
      out.token[i] = res.token_logprobs(static_cast<int>(i - b));
      out.entropy[i] = res.entropy(static_cast<int>(i - b));
    }
    if (backward && e > b && res.grad_hidden_states_size() == (e - b) * H)  // (a rank may own no rows)
      std::memcpy(out.dh.data() + b * H, res.grad_hidden_states().data(), (e - b) * H * sizeof(float));
  }
  return out;
}

/// Elements [begin * width, end * width) of `v`.
std::vector<double> Part(const std::vector<double>& v, int64_t begin, int64_t end, int64_t width) {
  return std::vector<double>(v.begin() + begin * width, v.begin() + end * width);
}
std::vector<float> Part(const std::vector<float>& v, int64_t begin, int64_t end, int64_t width) {
  return std::vector<float>(v.begin() + begin * width, v.begin() + end * width);
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// Checks every rank's sums of `step` against the float64 dL/dW, dL/db of
/// the problem's rows (all of them): its slice's rows, the step's counts.
void ExpectStepMatchesReference(const Problem& p, std::vector<std::unique_ptr<HeadGradientSteps>>& steps, int W,
                                int64_t micro_batches, int64_t tokens) {
  for (int r = 0; r < W; ++r) {
    const auto [vb, ve] = SplitRange(V, W, r);
    auto sums = steps[r]->Read(kStep, 0, ve - vb);
    ASSERT_TRUE(sums.ok()) << "rank " << r << ": " << sums.status();
    EXPECT_EQ(sums->head, "policy");
    EXPECT_EQ(sums->version, "v1");
    EXPECT_EQ(sums->rows, ve - vb);
    EXPECT_EQ(sums->hidden_size, H);
    EXPECT_TRUE(sums->has_bias);
    EXPECT_EQ(sums->micro_batches, micro_batches) << "rank " << r;
    EXPECT_EQ(sums->tokens, tokens) << "rank " << r;
    EXPECT_EQ(WithinRowTolerance(sums->weight, Part(p.dw, vb, ve, H), ve - vb, H, "dL/dW"), "") << "rank " << r;
    EXPECT_EQ(WithinRowTolerance(sums->bias, Part(p.db, vb, ve, 1), 1, ve - vb, "dL/db"), "") << "rank " << r;
  }
}

class BackwardItem : public ::testing::TestWithParam<int> {};

TEST_P(BackwardItem, GradientsMatchFloat64AndLogprobsTheForwardsBits) {
  const int W = GetParam();
  const Problem p = Make(kCase, 500 + W);
  auto steps = Steps(W);
  ItemSpec spec;
  spec.step = kStep;
  const auto results = RunRanks(p, Items(p, spec, W), &steps);
  const Rows got = Gather(results, N, true);
  for (int r = 0; r < W; ++r) {
    const auto [b, e] = SplitRange(N, W, r);
    EXPECT_EQ(WithinRowTolerance(Part(got.dh, b, e, H), Part(p.dh, b, e, H), e - b, H, "dL/dh"), "") << "rank " << r;
  }
  for (int64_t i = 0; i < N; ++i)
    EXPECT_NEAR(got.entropy[i], p.entropy[i], 1e-4 * std::max(1.0f, std::abs(p.entropy[i]))) << "row " << i;
  ExpectStepMatchesReference(p, steps, W, 1, N);

  // The forward of the same rows answers the same bits.
  ItemSpec forward;
  forward.backward = false;
  const Rows fwd = Gather(RunRanks(p, Items(p, forward, W), nullptr), N, false);
  EXPECT_TRUE(BitwiseEqual(got.token, fwd.token));
  EXPECT_TRUE(BitwiseEqual(got.entropy, fwd.entropy));
  for (int64_t i = 0; i < N; ++i)
    if (p.targets[i] < 0) {
      EXPECT_EQ(got.token[i], 0.0f) << "row " << i << " has no target";
    }
}

TEST_P(BackwardItem, MicroBatchesAccumulateIntoTheStep) {
  const int W = GetParam();
  const Problem p = Make(kCase, 600 + W);
  auto steps = Steps(W);
  Rows first, second;
  for (const auto& [b, e] : {std::pair<int64_t, int64_t>{0, 41}, std::pair<int64_t, int64_t>{41, N}}) {
    ItemSpec spec{b, e, true, true, kStep};
    const Rows got = Gather(RunRanks(p, Items(p, spec, W), &steps), e - b, true);
    EXPECT_EQ(WithinRowTolerance(got.dh, Part(p.dh, b, e, H), e - b, H, "dL/dh"), "") << "rows [" << b << ", " << e;
  }
  // The two micro-batches cover every row: the reference's sums.
  ExpectStepMatchesReference(p, steps, W, 2, N);
  // A backward without a step adds nothing to it.
  ItemSpec no_step{0, 10, true, true, ""};
  for (const auto& r : RunRanks(p, Items(p, no_step, W), &steps)) EXPECT_TRUE(r.ok()) << r.status();
  ExpectStepMatchesReference(p, steps, W, 2, N);
}

TEST_P(BackwardItem, WithoutGradEntropyMatchesAZeroGradEntropy) {
  const int W = GetParam();
  Problem p = Make(kCase, 700 + W);
  ItemSpec spec{0, N, true, false, ""};
  const Rows without = Gather(RunRanks(p, Items(p, spec, W), nullptr), N, true);
  std::fill(p.g_ent.begin(), p.g_ent.end(), 0.0f);
  spec.grad_entropy = true;
  const Rows zero = Gather(RunRanks(p, Items(p, spec, W), nullptr), N, true);
  for (int64_t i = 0; i < N * H; ++i) ASSERT_EQ(without.dh[i], zero.dh[i]) << "element " << i;
}

INSTANTIATE_TEST_SUITE_P(Workers, BackwardItem, ::testing::Values(1, 3));

TEST(BackwardItemRows, ARowsGradientIsBitwiseTheSameWithOtherRowsAround) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 800);
  const Rows all = Gather(RunRanks(p, Items(p, ItemSpec{0, N, true, true, ""}, W), nullptr), N, true);
  // Rows [20, 53): other rows around them, other rounds, other owners.
  const Rows some = Gather(RunRanks(p, Items(p, ItemSpec{20, 53, true, true, ""}, W), nullptr), 33, true);
  EXPECT_TRUE(BitwiseEqual(some.dh, Part(all.dh, 20, 53, H)));
  EXPECT_TRUE(BitwiseEqual(some.token, Part(all.token, 20, 53, 1)));
  EXPECT_TRUE(BitwiseEqual(some.entropy, Part(all.entropy, 20, 53, 1)));
  // Other round sizes.
  const Rows chunked = Gather(RunRanks(p, Items(p, ItemSpec{0, N, true, true, ""}, W), nullptr, /*chunk=*/16), N, true);
  EXPECT_TRUE(BitwiseEqual(chunked.dh, all.dh));
  // Fewer rows than ranks: rank 2 owns none.
  const Rows two = Gather(RunRanks(p, Items(p, ItemSpec{30, 32, true, true, ""}, W), nullptr), 2, true);
  EXPECT_TRUE(BitwiseEqual(two.dh, Part(all.dh, 30, 32, H)));
  EXPECT_TRUE(BitwiseEqual(two.token, Part(all.token, 30, 32, 1)));
}

TEST(BackwardItemRows, AnEmptyItemAddsAMicroBatchOfNoTokens) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 801);
  auto steps = Steps(W);
  const auto results = RunRanks(p, Items(p, ItemSpec{7, 7, true, true, kStep}, W), &steps);
  for (int r = 0; r < W; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r].status();
    EXPECT_EQ(results[r]->grad_hidden_states_size(), 0);
    const auto [vb, ve] = SplitRange(V, W, r);
    auto sums = steps[r]->Read(kStep, 0, ve - vb);
    ASSERT_TRUE(sums.ok()) << sums.status();
    EXPECT_EQ(sums->micro_batches, 1);
    EXPECT_EQ(sums->tokens, 0);
    EXPECT_EQ(sums->weight, std::vector<float>((ve - vb) * H, 0.0f));
  }
}

// ---------------------------------------------------------------------------
// A gradient step one rank refuses.

/// The sums of every rank's step, or its read error.
std::vector<absl::StatusOr<HeadGradientSums>> ReadAll(std::vector<std::unique_ptr<HeadGradientSteps>>& steps) {
  std::vector<absl::StatusOr<HeadGradientSums>> out;
  const int W = static_cast<int>(steps.size());
  for (int r = 0; r < W; ++r) {
    const auto [vb, ve] = SplitRange(V, W, r);
    out.push_back(steps[r]->Read(kStep, 0, ve - vb));
  }
  return out;
}

/// Every rank failed; `refusing` with `code`, the others ABORTED naming it.
void ExpectRefusedEverywhere(const std::vector<absl::StatusOr<WorkResult>>& results, int refusing,
                             absl::StatusCode code) {
  for (int r = 0; r < static_cast<int>(results.size()); ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    const absl::Status& st = results[r].status();
    if (r == refusing) {
      EXPECT_EQ(st.code(), code) << st;
    } else {
      EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << "rank " << r << ": " << st;
      EXPECT_NE(st.message().find(absl::StrCat("worker ", refusing, " refused")), std::string::npos) << st;
      EXPECT_NE(st.message().find("nothing was added"), std::string::npos) << st;
    }
  }
}

TEST(BackwardItemRefusal, AStepOneRankCannotOpenFailsEveryRankAndAddsNothing) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 900);
  auto steps = Steps(W);
  // Rank 1's worker has no room for the step's sums.
  steps[1] = std::make_unique<HeadGradientSteps>(HeadGradientSteps::Options{0, absl::Minutes(10)});
  const auto results = RunRanks(p, Items(p, ItemSpec{0, N, true, true, kStep}, W), &steps);
  ExpectRefusedEverywhere(results, 1, absl::StatusCode::kResourceExhausted);
  const auto sums = ReadAll(steps);
  EXPECT_EQ(sums[1].status().code(), absl::StatusCode::kNotFound) << "never opened on rank 1";
  for (int r : {0, 2}) {
    // Opened by the call, then kept as it was: nothing added, not dropped.
    ASSERT_TRUE(sums[r].ok()) << "rank " << r << ": " << sums[r].status();
    EXPECT_EQ(sums[r]->micro_batches, 0);
    EXPECT_EQ(sums[r]->tokens, 0);
    for (float x : sums[r]->weight) ASSERT_EQ(x, 0.0f) << "rank " << r;
    for (float x : sums[r]->bias) ASSERT_EQ(x, 0.0f) << "rank " << r;
  }
}

TEST(BackwardItemRefusal, AKeyClosedOnOneRankFailsEveryRankAndKeepsTheOthersSums) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 901);
  auto steps = Steps(W);
  for (const auto& r : RunRanks(p, Items(p, ItemSpec{0, 30, true, true, kStep}, W), &steps))
    ASSERT_TRUE(r.ok()) << r.status();
  const auto before = ReadAll(steps);
  ASSERT_TRUE(steps[2]->Close(kStep).ok());
  const auto results = RunRanks(p, Items(p, ItemSpec{30, N, true, true, kStep}, W), &steps);
  ExpectRefusedEverywhere(results, 2, absl::StatusCode::kAlreadyExists);
  const auto after = ReadAll(steps);
  EXPECT_EQ(after[2].status().code(), absl::StatusCode::kAlreadyExists);
  for (int r : {0, 1}) {
    ASSERT_TRUE(before[r].ok() && after[r].ok()) << "rank " << r << ": " << after[r].status();
    EXPECT_EQ(after[r]->micro_batches, 1) << "rank " << r;
    EXPECT_EQ(after[r]->tokens, 30) << "rank " << r;
    EXPECT_TRUE(BitwiseEqual(after[r]->weight, before[r]->weight)) << "rank " << r;
    EXPECT_TRUE(BitwiseEqual(after[r]->bias, before[r]->bias)) << "rank " << r;
  }
}

TEST(BackwardItemRefusal, AStepBoundToAnotherVersionOnRankZeroFailsEveryRank) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 902);
  auto steps = Steps(W);
  const auto [vb, ve] = SplitRange(V, W, 0);
  ASSERT_TRUE(
      steps[0]
          ->Accumulate(kStep, "policy", "v0", ve - vb, H, true, 1, [](HeadGradientSums&) { return absl::OkStatus(); })
          .ok());
  const auto results = RunRanks(p, Items(p, ItemSpec{0, N, true, true, kStep}, W), &steps);
  ExpectRefusedEverywhere(results, 0, absl::StatusCode::kFailedPrecondition);
  const auto sums = ReadAll(steps);
  ASSERT_TRUE(sums[0].ok()) << sums[0].status();
  EXPECT_EQ(sums[0]->version, "v0");
  EXPECT_EQ(sums[0]->micro_batches, 1);
  for (int r : {1, 2}) {
    ASSERT_TRUE(sums[r].ok()) << sums[r].status();
    EXPECT_EQ(sums[r]->micro_batches, 0);
  }
}

TEST(BackwardItemStop, AStopBeforeTheFirstRoundCancelsEveryRankAndKeepsTheStep) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 903);
  auto steps = Steps(W);
  // A first micro-batch in the step, then a backward stopped at once.
  const auto first = RunRanks(p, Items(p, ItemSpec{0, N, true, true, kStep}, W), &steps);
  for (int r = 0; r < W; ++r) ASSERT_TRUE(first[r].ok()) << first[r].status();
  std::vector<std::vector<float>> before;
  for (const auto& s : ReadAll(steps)) before.push_back(s->weight);
  const auto results =
      RunRanks(p, Items(p, ItemSpec{0, N, true, true, kStep}, W), &steps, kChunk, [](int rank) { return rank == 2; });
  for (int r = 0; r < W; ++r) {
    ASSERT_FALSE(results[r].ok());
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kCancelled) << "rank " << r << ": " << results[r].status();
  }
  // Nothing was added: the step is as the first micro-batch left it.
  const auto after = ReadAll(steps);
  for (int r = 0; r < W; ++r) {
    ASSERT_TRUE(after[r].ok()) << after[r].status();
    EXPECT_EQ(after[r]->micro_batches, 1);
    EXPECT_EQ(after[r]->weight, before[r]) << "rank " << r;
  }
}

TEST(BackwardItemStop, AStopAfterARoundAddedDropsTheStep) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 904);
  auto steps = Steps(W);
  // Rank 2 asks to stop at its second poll: after the first round added.
  std::atomic<int> polls{0};
  const auto results = RunRanks(p, Items(p, ItemSpec{0, N, true, true, kStep}, W), &steps, kChunk,
                                [&polls](int rank) { return rank == 2 && ++polls >= 2; });
  for (int r = 0; r < W; ++r) {
    ASSERT_FALSE(results[r].ok());
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kCancelled) << "rank " << r << ": " << results[r].status();
  }
  // The step's sums are unspecified once a backward failed inside it: dropped on every rank.
  for (const auto& s : ReadAll(steps))
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
}

// ---------------------------------------------------------------------------
// Items that are not a consistent backward: refused on every rank before any
// collective (the group is never aborted: a rank that waited would fail
// with DEADLINE_EXCEEDED, not INVALID_ARGUMENT).

TEST(BackwardItemErrors, InconsistentItemsAreInvalidArgument) {
  constexpr int W = 3;
  const Problem p = Make(kCase, 1000);
  struct BadCase {
    const char* what;
    std::function<void(WorkItem&)> change;
  };
  const std::vector<BadCase> cases = {
      {"vocab-parallel layout", [](WorkItem& i) { i.set_layout(internal::v1::VOCAB_PARALLEL); }},
      {"token-parallel layout", [](WorkItem& i) { i.set_layout(internal::v1::TOKEN_PARALLEL); }},
      {"a grad_token_logprobs short", [](WorkItem& i) { i.mutable_grad_token_logprobs()->RemoveLast(); }},
      {"a grad_entropy short", [](WorkItem& i) { i.mutable_grad_entropy()->RemoveLast(); }},
      {"a target short", [](WorkItem& i) { i.mutable_targets()->RemoveLast(); }},
      {"sampling_top_k", [](WorkItem& i) { i.mutable_options()->set_sampling_top_k(5); }},
      {"sampling_top_p", [](WorkItem& i) { i.mutable_options()->set_sampling_top_p(0.5f); }},
      {"topk", [](WorkItem& i) { i.mutable_options()->set_topk(2); }},
      {"is_top1", [](WorkItem& i) { i.mutable_options()->set_is_top1(true); }},
      {"log_sum_sq_probs", [](WorkItem& i) { i.mutable_options()->set_log_sum_sq_probs(true); }},
      {"mean_logits", [](WorkItem& i) { i.mutable_options()->set_mean_logits(true); }},
      {"gather_k",
       [](WorkItem& i) {
         i.set_gather_k(1);
         for (int r = 0; r < i.num_rows(); ++r) i.add_gather_ids(0);
       }},
      {"a sampling mask",
       [](WorkItem& i) {
         i.add_mask_offsets(0);
         for (int r = 0; r < i.num_rows(); ++r) {
           i.add_masked(false);
           i.add_mask_offsets(0);
         }
       }},
      {"a dtype that is not a float", [](WorkItem& i) { i.set_dtype(v1::I64); }},
      {"a vocabulary slice that is not the rank's", [](WorkItem& i) { i.set_vocab_begin(i.vocab_begin() + 1); }},
      {"another H", [](WorkItem& i) { i.set_hidden_size(H + 1); }},
      {"hidden states of the wrong size", [](WorkItem& i) { i.mutable_data()->pop_back(); }},
  };
  for (const BadCase& c : cases) {
    auto steps = Steps(W);
    std::vector<WorkItem> items = Items(p, ItemSpec{0, N, true, true, kStep}, W);
    for (WorkItem& i : items) c.change(i);
    const auto results = RunRanks(p, items, &steps);
    for (int r = 0; r < W; ++r) {
      ASSERT_FALSE(results[r].ok()) << c.what << ", rank " << r;
      EXPECT_EQ(results[r].status().code(), absl::StatusCode::kInvalidArgument)
          << c.what << ", rank " << r << ": " << results[r].status();
      EXPECT_EQ(steps[r]->open_steps(), 0u) << c.what << ": no step opened";
    }
  }
}

TEST(BackwardItemErrors, WithoutTheLmHeadItIsFailedPrecondition) {
  const Problem p = Make(kCase, 1001);
  const WorkItem item = ItemFor(p, ItemSpec{0, N, true, true, kStep}, 1, 0);
  CpuBackend backend(1);
  InProcessGroup group(1);
  InProcessCommunicator comm(group, 0);
  HeadGradientSteps steps({1 << 20, absl::Minutes(10)});
  auto res = RunBackwardItem(item, ItemPayload(item.data()), comm, backend, kChunk, {}, nullptr, steps);
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), absl::StatusCode::kFailedPrecondition) << res.status();
  EXPECT_EQ(steps.open_steps(), 0u);
}

}  // namespace
}  // namespace logprob::testing
