// The front-end's side of the lm_head's backward (issue 47), without workers:
// BuildScoreJob's grad_token_logprobs / grad_entropy (per row, 0 at ignored
// targets; errors naming the field and position), ExpandToInputRows,
// ConcatJobs and the batcher's keys (which backwards share a batch), BuildResponse's grad_hidden_states (each
// row at its input row, zeros elsewhere), and ReadHeadGradients /
// CloseHeadGradientStep over a fake GradientStepWorkers (pieces in row
// order with global rows, piece size, head and range checks).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/partition.h"
#include "server/core/batcher.h"
#include "server/core/head_gradients.h"
#include "server/core/planner.h"
#include "server/core/response_builder.h"
#include "server/core/score_job.h"
#include "server/heads/lm_heads.h"
#include "tests/tensor_values.h"

namespace logprob {
namespace {

constexpr int64_t kV = 10, kH = 3;
const LmHeadShape kHead{kV, kH};
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

template <typename T>
v1::Tensor Make(const std::string& name, v1::DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  return testing::TensorOf(name, dtype, shape, values);
}

std::vector<float> Hidden(int64_t rows) {
  std::vector<float> h(rows * kH);
  for (size_t i = 0; i < h.size(); ++i) h[i] = 0.25f * static_cast<float>(i);
  return h;
}

/// Padded hidden states [2, 4, H], seq_lens {4, 3}, next_token: outputs
/// [2, 3]; scored rows 0, 1, 2 (targets 1, ignored, 7) and 4, 5 (targets 3,
/// 0). grad_token_logprobs is NaN at the ignored target and 9 past seq_lens
/// (neither is read); grad_entropy NaN past seq_lens.
v1::ScoreRequest Padded(bool grad_entropy = true) {
  v1::ScoreRequest req;
  *req.add_inputs() = Make<float>("hidden_states", v1::F32, {2, 4, kH}, Hidden(8));
  *req.add_inputs() = Make<int64_t>("input_ids", v1::I64, {2, 4}, {5, 1, -100, 7, 2, 3, 0, 9});
  *req.add_inputs() = Make<int64_t>("seq_lens", v1::I64, {2}, {4, 3});
  *req.add_inputs() = Make<float>("grad_token_logprobs", v1::F32, {2, 3}, {0.5f, kNan, -1.25f, 2.0f, 0.75f, 9.0f});
  if (grad_entropy)
    *req.add_inputs() = Make<float>("grad_entropy", v1::F32, {2, 3}, {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, kNan});
  req.mutable_options()->set_entropy(true);
  return req;
}

/// Packed hidden states [5, H], cu_seqlens {0, 3, 5}, next_token: outputs
/// [3]; scored rows 0 (ignored target), 1 (target 6) and 3 (target 9).
v1::ScoreRequest Packed(bool grad_entropy = true) {
  v1::ScoreRequest req;
  *req.add_inputs() = Make<float>("hidden_states", v1::F32, {5, kH}, Hidden(5));
  *req.add_inputs() = Make<int64_t>("input_ids", v1::I64, {5}, {4, -100, 6, 8, 9});
  *req.add_inputs() = Make<int64_t>("cu_seqlens", v1::I64, {3}, {0, 3, 5});
  *req.add_inputs() = Make<float>("grad_token_logprobs", v1::F32, {3}, {3.0f, -0.5f, 1.5f});
  if (grad_entropy) *req.add_inputs() = Make<float>("grad_entropy", v1::F32, {3}, {-0.1f, -0.2f, -0.3f});
  req.mutable_options()->set_entropy(true);
  return req;
}

/// `req` without its input `name`.
v1::ScoreRequest Without(v1::ScoreRequest req, const std::string& name) {
  auto* inputs = req.mutable_inputs();
  for (int i = 0; i < inputs->size(); ++i)
    if (inputs->Get(i).name() == name) {
      inputs->DeleteSubrange(i, 1);
      break;
    }
  return req;
}

/// `req` with input `name` replaced by `t` (added when absent).
v1::ScoreRequest With(v1::ScoreRequest req, const v1::Tensor& t) {
  req = Without(std::move(req), t.name());
  *req.add_inputs() = t;
  return req;
}

/// The job of `req`, which is kept for the test's life: a job's rows point
/// into its request's bytes (InlineInputs).
ScoreJob Build(v1::ScoreRequest req) {
  static auto* const kept = new std::vector<std::unique_ptr<v1::ScoreRequest>>;
  kept->push_back(std::make_unique<v1::ScoreRequest>(std::move(req)));
  auto job = BuildScoreJob(*kept->back(), RequestLimits{}, kHead);
  EXPECT_TRUE(job.ok()) << job.status();
  return job.ok() ? *std::move(job) : ScoreJob{};
}

// ---------------------------------------------------------------------------
// BuildScoreJob

TEST(BackwardJob, PaddedKeepsEachRowsUpstreamGradients) {
  const ScoreJob job = Build(Padded());
  EXPECT_TRUE(job.backward);
  EXPECT_EQ(job.rows, (std::vector<int64_t>{0, 1, 2, 4, 5}));
  EXPECT_EQ(job.targets, (std::vector<int64_t>{1, -1, 7, 3, 0}));
  EXPECT_EQ(job.grad_logprobs, (std::vector<float>{0.5f, 0.0f, -1.25f, 2.0f, 0.75f})) << "0 at the ignored target";
  EXPECT_EQ(job.grad_entropy, (std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f, 0.5f}));
  EXPECT_EQ(job.input_shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(job.out_shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(job.backward_working_bytes(), 4 * kH * (2 * 5 + 2 * 8));
}

TEST(BackwardJob, PackedWithoutGradEntropy) {
  const ScoreJob job = Build(Packed(/*grad_entropy=*/false));
  EXPECT_TRUE(job.backward);
  EXPECT_EQ(job.rows, (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(job.grad_logprobs, (std::vector<float>{0.0f, -0.5f, 1.5f}));
  EXPECT_TRUE(job.grad_entropy.empty());
  EXPECT_EQ(job.input_shape, (std::vector<int64_t>{5}));
}

TEST(BackwardJob, AForwardHasNone) {
  const ScoreJob job = Build(Without(Without(Padded(), "grad_entropy"), "grad_token_logprobs"));
  EXPECT_FALSE(job.backward);
  EXPECT_TRUE(job.grad_logprobs.empty());
  EXPECT_TRUE(job.grad_entropy.empty());
  EXPECT_TRUE(job.input_shape.empty());
  EXPECT_EQ(job.backward_working_bytes(), 0);
}

TEST(BackwardJob, GradientStepKeys) {
  for (const std::string& key :
       std::vector<std::string>{"run-7/step-12", "a", "A.b_c:d/e+f-0", std::string(128, 'k')}) {
    v1::ScoreRequest req = Padded();
    req.mutable_options()->set_gradient_step(key);
    auto job = BuildScoreJob(req, RequestLimits{}, kHead);
    ASSERT_TRUE(job.ok()) << key << ": " << job.status();
    EXPECT_EQ(job->options.gradient_step(), key) << "kept for the workers";
  }
  EXPECT_TRUE(ValidGradientStepKey("run-7/step-12"));
  EXPECT_FALSE(ValidGradientStepKey(""));
  EXPECT_FALSE(ValidGradientStepKey(std::string(129, 'k')));
  EXPECT_FALSE(ValidGradientStepKey("has space"));
  EXPECT_FALSE(ValidGradientStepKey("star*"));
  EXPECT_FALSE(ValidGradientStepKey(std::string("nul\0", 4)));
}

TEST(BackwardJob, RefusesWhatIsNotABackward) {
  struct Case {
    v1::ScoreRequest req;
    std::string message;
  };
  std::vector<Case> cases;
  auto with_options = [](v1::ScoreRequest req, auto set) {
    set(req.mutable_options());
    return req;
  };
  // Non-finite upstream gradients where they count, named with their position.
  cases.push_back({With(Padded(), Make<float>("grad_token_logprobs", v1::F32, {2, 3}, {0, 0, 0, 0, kNan, 0})),
                   "\"grad_token_logprobs\": nan at sequence 1 position 1 is not finite"});
  cases.push_back({With(Padded(), Make<float>("grad_token_logprobs", v1::F32, {2, 3}, {-INFINITY, 0, 0, 0, 0, 0})),
                   "\"grad_token_logprobs\": -inf at sequence 0 position 0 is not finite"});
  cases.push_back({With(Padded(), Make<float>("grad_entropy", v1::F32, {2, 3}, {0, 0, INFINITY, 0, 0, 0})),
                   "\"grad_entropy\": inf at sequence 0 position 2 is not finite"});
  cases.push_back({With(Padded(), Make<float>("grad_entropy", v1::F32, {2, 3}, {0, kNan, 0, 0, 0, 0})),
                   "\"grad_entropy\": nan at sequence 0 position 1 is not finite"});
  // Dtype and shape.
  cases.push_back({With(Padded(), Make<uint16_t>("grad_token_logprobs", v1::BF16, {2, 3}, std::vector<uint16_t>(6))),
                   "\"grad_token_logprobs\": dtype BF16 is not F32"});
  cases.push_back({With(Padded(), Make<uint16_t>("grad_entropy", v1::F16, {2, 3}, std::vector<uint16_t>(6))),
                   "\"grad_entropy\": dtype F16 is not F32"});
  cases.push_back({With(Padded(), Make<float>("grad_token_logprobs", v1::F32, {6}, std::vector<float>(6))),
                   "\"grad_token_logprobs\": shape [6] does not match the output shape [2, 3]"});
  cases.push_back({With(Padded(), Make<float>("grad_entropy", v1::F32, {2, 4}, std::vector<float>(8))),
                   "\"grad_entropy\": shape [2, 4] does not match the output shape [2, 3]"});
  // Logits instead of hidden states.
  {
    v1::ScoreRequest req = Without(Padded(), "hidden_states");
    *req.add_inputs() = Make<float>("logits", v1::F32, {2, 4, kV}, std::vector<float>(2 * 4 * kV));
    cases.push_back({req, "\"grad_token_logprobs\": the lm_head's backward takes \"hidden_states\", not logits"});
  }
  // Sampling filters and masks.
  cases.push_back({with_options(Padded(), [](v1::ScoreOptions* o) { o->set_sampling_top_k(3); }),
                   "the lm_head's backward has no sampling filters or masks"});
  cases.push_back({with_options(Padded(), [](v1::ScoreOptions* o) { o->set_sampling_top_p(0.9f); }),
                   "the lm_head's backward has no sampling filters or masks"});
  {
    v1::ScoreRequest req = Padded();
    *req.add_inputs() = Make<int64_t>("sampling_mask_offsets", v1::I64, {7}, {0, 1, 1, 1, 1, 1, 1});
    *req.add_inputs() = Make<int64_t>("sampling_mask_ids", v1::I64, {1}, {1});
    cases.push_back({req, "the lm_head's backward has no sampling filters or masks"});
  }
  // Outputs other than token_logprobs, entropy and grad_hidden_states.
  const std::string only = "the lm_head's backward answers token_logprobs, entropy and grad_hidden_states only";
  cases.push_back({with_options(Padded(), [](v1::ScoreOptions* o) { o->set_topk(2); }), only});
  cases.push_back({with_options(Padded(), [](v1::ScoreOptions* o) { o->set_is_top1(true); }), only});
  cases.push_back({with_options(Padded(), [](v1::ScoreOptions* o) { o->set_mean_logits(true); }), only});
  cases.push_back({with_options(Padded(), [](v1::ScoreOptions* o) { o->set_log_sum_sq_probs(true); }), only});
  {
    v1::ScoreRequest req = Padded();
    *req.add_inputs() = Make<int64_t>("gather_indices", v1::I64, {2, 3, 1}, std::vector<int64_t>(6, 0));
    cases.push_back({req, only});
  }
  {
    v1::ScoreRequest req = Padded();
    *req.add_inputs() = Make<float>("rollout_logprobs", v1::F32, {2, 3}, std::vector<float>(6, -1.0f));
    cases.push_back({req, only});
  }
  // A gradient step without a backward, a malformed key, grad_entropy alone.
  cases.push_back({with_options(Without(Without(Padded(), "grad_entropy"), "grad_token_logprobs"),
                                [](v1::ScoreOptions* o) { o->set_gradient_step("s"); }),
                   "options.gradient_step is for the lm_head's backward: give \"grad_token_logprobs\" too"});
  cases.push_back({Without(Padded(), "grad_token_logprobs"),
                   "\"grad_entropy\" needs \"grad_token_logprobs\" (the lm_head's backward)"});
  for (const std::string& bad :
       std::vector<std::string>{"has space", "star*", std::string(129, 'k'), "\xc3\xa9", std::string("a\0b", 3)})
    cases.push_back({with_options(Padded(), [&bad](v1::ScoreOptions* o) { o->set_gradient_step(bad); }),
                     "options.gradient_step must be 1..128 characters of [A-Za-z0-9._:/+-]"});
  for (size_t i = 0; i < cases.size(); ++i) {
    auto job = BuildScoreJob(cases[i].req, RequestLimits{}, kHead);
    ASSERT_FALSE(job.ok()) << i << ": " << cases[i].message;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << i << ": " << job.status();
    EXPECT_NE(job.status().message().find(cases[i].message), std::string::npos) << i << ": " << job.status();
  }
}

TEST(BackwardJob, ExpandedRowsHaveNoGradient) {
  ScoreJob job = Build(Padded());
  ExpandToInputRows(8, &job);
  EXPECT_EQ(job.grad_logprobs, (std::vector<float>{0.5f, 0, -1.25f, 0, 2.0f, 0.75f, 0, 0}));
  EXPECT_EQ(job.grad_entropy, (std::vector<float>{0.1f, 0.2f, 0.3f, 0, 0.4f, 0.5f, 0, 0}));
  EXPECT_EQ(job.targets, (std::vector<int64_t>{1, -1, 7, -1, 3, 0, -1, -1}));
  ScoreJob no_entropy = Build(Padded(false));
  ExpandToInputRows(8, &no_entropy);
  EXPECT_EQ(no_entropy.grad_logprobs.size(), 8u);
  EXPECT_TRUE(no_entropy.grad_entropy.empty());
}

// ---------------------------------------------------------------------------
// Batches

TEST(BackwardBatch, ConcatJobsKeepsTheGradientsAligned) {
  const ScoreJob a = Build(Padded()), b = Build(Packed());
  const ScoreJob all = ConcatJobs({&a, &b});
  EXPECT_TRUE(all.backward);
  EXPECT_EQ(all.targets, (std::vector<int64_t>{1, -1, 7, 3, 0, -1, 6, 9}));
  EXPECT_EQ(all.grad_logprobs, (std::vector<float>{0.5f, 0.0f, -1.25f, 2.0f, 0.75f, 0.0f, -0.5f, 1.5f}));
  EXPECT_EQ(all.grad_entropy, (std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f, 0.5f, -0.1f, -0.2f, -0.3f}));
  EXPECT_EQ(all.grad_logprobs.size(), all.rows.size());
  // Its work items carry each row's gradients.
  const Plan plan = PlanWork(all, 3, Parallelism::kAuto, 7);
  ASSERT_EQ(plan.items.size(), 3u);
  for (const PlannedItem& p : plan.items) {
    EXPECT_TRUE(p.item.backward());
    EXPECT_EQ(std::vector<float>(p.item.grad_token_logprobs().begin(), p.item.grad_token_logprobs().end()),
              all.grad_logprobs);
    EXPECT_EQ(std::vector<float>(p.item.grad_entropy().begin(), p.item.grad_entropy().end()), all.grad_entropy);
  }
  const ScoreJob fa = Build(Without(Without(Padded(), "grad_entropy"), "grad_token_logprobs"));
  const Plan forward = PlanWork(fa, 2, Parallelism::kAuto, 8);
  for (const PlannedItem& p : forward.items) {
    EXPECT_FALSE(p.item.backward());
    EXPECT_EQ(p.item.grad_token_logprobs_size(), 0);
  }
}

// ---------------------------------------------------------------------------
// BuildResponse

/// The value a fake worker answers for element k of dL/dh of plan row p.
float GradValue(int64_t p, int64_t k) { return static_cast<float>(100 * (p + 1) + k); }

/// Results of `plan` (HIDDEN_STATES over `n` rows) as the workers answer:
/// rows SplitRange(n, W, w) of item w, token logprob -(p + 1) and dL/dh
/// GradValue(p, .) for plan row p. `short_grad`: one item's dL/dh one
/// element short.
std::vector<internal::v1::WorkResult> Results(const Plan& plan, int64_t n, bool short_grad = false) {
  const int W = static_cast<int>(plan.items.size());
  std::vector<internal::v1::WorkResult> out;
  for (int w = 0; w < W; ++w) {
    const auto [b, e] = SplitRange(n, W, w);
    internal::v1::WorkResult r;
    r.set_row_begin(b);
    r.set_row_end(e);
    for (int64_t p = b; p < e; ++p) {
      r.add_token_logprobs(-static_cast<float>(p + 1));
      r.add_entropy(0.5f);
      for (int64_t k = 0; k < kH; ++k) r.add_grad_hidden_states(GradValue(p, k));
    }
    if (short_grad && w == W - 1) r.mutable_grad_hidden_states()->RemoveLast();
    out.push_back(std::move(r));
  }
  return out;
}

const v1::Tensor* Output(const v1::ScoreResponse& resp, const std::string& name) {
  for (const v1::Tensor& t : resp.outputs())
    if (t.name() == name) return &t;
  return nullptr;
}

/// Checks `resp`'s grad_hidden_states: [input_shape, H], row job.rows[j] is
/// plan row row_begin + j's, the other input rows zero.
void ExpectGradRows(const v1::ScoreResponse& resp, const ScoreJob& job, int64_t row_begin) {
  const v1::Tensor* g = Output(resp, "grad_hidden_states");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->dtype(), v1::F32);
  std::vector<int64_t> shape = job.input_shape;
  shape.push_back(kH);
  EXPECT_EQ(std::vector<int64_t>(g->shape().begin(), g->shape().end()), shape);
  int64_t input_rows = 1;
  for (int64_t d : job.input_shape) input_rows *= d;
  ASSERT_EQ(g->data().size(), static_cast<size_t>(input_rows * kH) * sizeof(float));
  std::vector<float> want(input_rows * kH, 0.0f), got(input_rows * kH);
  for (int64_t j = 0; j < job.num_rows(); ++j)
    for (int64_t k = 0; k < kH; ++k) want[job.rows[j] * kH + k] = GradValue(row_begin + j, k);
  std::memcpy(got.data(), g->data().data(), g->data().size());
  EXPECT_EQ(got, want);
}

TEST(BackwardResponse, GradHiddenStatesRowsAreAtTheirInputRows) {
  for (int W : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << W << " workers");
    for (const v1::ScoreRequest& req : {Padded(), Packed()}) {
      const ScoreJob job = Build(req);
      const Plan plan = PlanWork(job, W, Parallelism::kAuto, 1);
      auto resp = BuildResponse(job, plan, Results(plan, job.num_rows()));
      ASSERT_TRUE(resp.ok()) << resp.status();
      ExpectGradRows(*resp, job, 0);
      const v1::Tensor* lp = Output(*resp, "token_logprobs");
      ASSERT_NE(lp, nullptr);
      std::vector<float> got(job.num_outputs());
      std::memcpy(got.data(), lp->data().data(), got.size() * sizeof(float));
      for (int64_t j = 0; j < job.num_rows(); ++j) EXPECT_EQ(got[job.out_pos[j]], -static_cast<float>(j + 1));
    }
  }
}

TEST(BackwardResponse, EachJobOfABatchGetsItsOwnRows) {
  const ScoreJob a = Build(Padded()), b = Build(Packed());
  const ScoreJob all = ConcatJobs({&a, &b});
  const Plan plan = PlanWork(all, 3, Parallelism::kAuto, 1);
  const auto results = Results(plan, all.num_rows());
  auto ra = BuildResponse(a, plan, results, 0);
  auto rb = BuildResponse(b, plan, results, a.num_rows());
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << " / " << rb.status();
  ExpectGradRows(*ra, a, 0);
  ExpectGradRows(*rb, b, a.num_rows());
}

TEST(BackwardResponse, AnExpandedJobAnswersEveryInputRow) {
  ScoreJob job = Build(Padded());
  ExpandToInputRows(8, &job);
  const Plan plan = PlanWork(job, 2, Parallelism::kAuto, 1);
  auto resp = BuildResponse(job, plan, Results(plan, job.num_rows()));
  ASSERT_TRUE(resp.ok()) << resp.status();
  ExpectGradRows(*resp, job, 0);
}

TEST(BackwardResponse, AForwardHasNoGradientAndMalformedResultsAreInternal) {
  const ScoreJob forward = Build(Without(Without(Padded(), "grad_entropy"), "grad_token_logprobs"));
  const Plan fplan = PlanWork(forward, 2, Parallelism::kAuto, 1);
  auto fresults = Results(fplan, forward.num_rows());
  for (auto& r : fresults) r.clear_grad_hidden_states();
  auto fresp = BuildResponse(forward, fplan, fresults);
  ASSERT_TRUE(fresp.ok()) << fresp.status();
  EXPECT_EQ(Output(*fresp, "grad_hidden_states"), nullptr);

  const ScoreJob job = Build(Padded());
  const Plan plan = PlanWork(job, 2, Parallelism::kAuto, 1);
  auto resp = BuildResponse(job, plan, Results(plan, job.num_rows(), /*short_grad=*/true));
  EXPECT_EQ(resp.status().code(), absl::StatusCode::kInternal) << resp.status();
  auto none = Results(plan, job.num_rows());
  none[0].clear_grad_hidden_states();
  EXPECT_EQ(BuildResponse(job, plan, none).status().code(), absl::StatusCode::kInternal);
}

// ---------------------------------------------------------------------------
// The batcher: which backwards share a batch

/// A Runner that holds its batches until Release() and answers each as
/// Results does; counts its calls and the queued jobs (on_queue_change).
class GateRunner {
 public:
  Batcher::Runner runner() {
    return [this](const Plan& plan, const RunBounds&) -> absl::StatusOr<std::vector<internal::v1::WorkResult>> {
      std::unique_lock<std::mutex> lock(mu_);
      ++calls_;
      cv_.notify_all();
      if (!cv_.wait_for(lock, kTimeout, [&] { return released_; }))
        return absl::DeadlineExceededError("never released");
      return Results(plan, plan.items.front().item.num_rows());
    };
  }
  std::function<void(int64_t)> on_queue_change() {
    return [this](int64_t n) {
      std::lock_guard<std::mutex> lock(mu_);
      queued_ = n;
      cv_.notify_all();
    };
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  bool WaitCalls(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kTimeout, [&] { return calls_ >= n; });
  }
  bool WaitQueued(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kTimeout, [&] { return queued_ == n; });
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  static constexpr auto kTimeout = std::chrono::seconds(60);  // only prevents hangs
  std::mutex mu_;
  std::condition_variable cv_;
  int calls_ = 0;
  int64_t queued_ = 0;
  bool released_ = false;
};

TEST(BackwardBatch, BackwardsShareABatchOnlyWithTheSameGradientInputsAndStep) {
  GateRunner gate;
  Batcher::Options o;
  o.max_queue_delay = std::chrono::hours(1);  // queued jobs wait for the busy batch
  o.workers = 1;
  o.on_queue_change = gate.on_queue_change();
  Batcher batcher(o, gate.runner());
  auto start = [&batcher](std::shared_ptr<const ScoreJob> job, uint64_t id) {
    return std::async(std::launch::async, [&batcher, job, id] { return batcher.Run(job, id, RunBounds{}); });
  };
  v1::ScoreRequest busy_req = Without(Without(Packed(), "grad_entropy"), "grad_token_logprobs");
  busy_req.mutable_options()->set_entropy(false);
  auto busy = start(std::make_shared<const ScoreJob>(Build(busy_req)), 1);
  ASSERT_TRUE(gate.WaitCalls(1));
  v1::ScoreRequest stepped = Padded();
  stepped.mutable_options()->set_gradient_step("step-2");
  const std::vector<std::shared_ptr<const ScoreJob>> jobs = {
      std::make_shared<const ScoreJob>(Build(Padded())),       // 0: backward + grad_entropy
      std::make_shared<const ScoreJob>(Build(Padded(false))),  // 1: backward
      std::make_shared<const ScoreJob>(Build(Without(Without(Padded(), "grad_entropy"), "grad_token_logprobs"))),
      std::make_shared<const ScoreJob>(Build(Packed())),       // 3: with 0
      std::make_shared<const ScoreJob>(Build(stepped)),        // 4: another step
      std::make_shared<const ScoreJob>(Build(Packed(false))),  // 5: with 1
  };
  std::vector<std::future<absl::StatusOr<Batcher::Outcome>>> runs;
  for (size_t i = 0; i < jobs.size(); ++i) {
    runs.push_back(start(jobs[i], 10 + i));
    ASSERT_TRUE(gate.WaitQueued(static_cast<int64_t>(i + 1))) << "job " << i;
  }
  EXPECT_EQ(gate.calls(), 1);
  gate.Release();
  ASSERT_EQ(busy.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_TRUE(busy.get().ok());
  std::vector<Batcher::Outcome> outcomes;
  for (size_t i = 0; i < runs.size(); ++i) {
    ASSERT_EQ(runs[i].wait_for(std::chrono::seconds(60)), std::future_status::ready) << "job " << i;
    auto outcome = runs[i].get();
    ASSERT_TRUE(outcome.ok()) << "job " << i << ": " << outcome.status();
    outcomes.push_back(*std::move(outcome));
  }
  EXPECT_EQ(outcomes[0].plan, outcomes[3].plan) << "backwards with grad_entropy";
  EXPECT_EQ(outcomes[1].plan, outcomes[5].plan) << "backwards without grad_entropy";
  for (auto [x, y] : {std::pair{0, 1}, {0, 2}, {0, 4}, {1, 2}, {1, 4}, {2, 4}})
    EXPECT_NE(outcomes[x].plan, outcomes[y].plan) << "jobs " << x << " and " << y;
  for (int i : {0, 1, 3, 5}) EXPECT_EQ(outcomes[i].batch_requests, 2) << "job " << i;
  for (int i : {2, 4}) EXPECT_EQ(outcomes[i].batch_requests, 1) << "job " << i;
  EXPECT_EQ(outcomes[3].row_begin, jobs[0]->num_rows());
  EXPECT_EQ(outcomes[5].row_begin, jobs[1]->num_rows());
  EXPECT_TRUE(outcomes[4].plan->items.front().item.backward());
  EXPECT_EQ(outcomes[4].plan->items.front().item.options().gradient_step(), "step-2");
  EXPECT_FALSE(outcomes[2].plan->items.front().item.backward());
  // Each backward's answer holds its own rows' dL/dh.
  for (int i : {0, 1, 3, 4, 5}) {
    SCOPED_TRACE(::testing::Message() << "job " << i);
    auto resp = BuildResponse(*jobs[i], *outcomes[i].plan, *outcomes[i].results, outcomes[i].row_begin);
    ASSERT_TRUE(resp.ok()) << resp.status();
    ExpectGradRows(*resp, *jobs[i], outcomes[i].row_begin);
  }
}

// ---------------------------------------------------------------------------
// ReadHeadGradients / CloseHeadGradientStep over fake workers

/// W fake workers holding one step's sums of head "policy" [V, H]: element
/// (global row g, k) of dL/dW is 1000 g + k, dL/db of g is -g. Records the
/// requests they got.
class FakeSteps {
 public:
  explicit FakeSteps(int W) : W_(W) {}

  GradientStepWorkers workers() {
    GradientStepWorkers w;
    w.size = W_;
    w.read = [this](int rank, const internal::v1::WorkerHeadGradientsRequest& req) { return Read(rank, req); };
    w.close = [this](const std::string& step) {
      closed.push_back(step);
      return close_status;
    };
    return w;
  }

  struct Call {
    int rank;
    int64_t begin, end;
  };
  std::vector<Call> calls;
  std::vector<std::string> closed;
  std::string head = "policy";
  int64_t hidden_size = kH;
  absl::Status error;  // answered by every read when not OK
  absl::Status close_status;
  bool short_weight = false;

 private:
  absl::StatusOr<v1::HeadGradientsChunk> Read(int rank, const internal::v1::WorkerHeadGradientsRequest& req) {
    calls.push_back({rank, req.row_begin(), req.row_end()});
    if (!error.ok()) return error;
    EXPECT_EQ(req.gradient_step(), "run/step-1");
    const auto [vb, ve] = SplitRange(kV, W_, rank);
    if (req.row_begin() < 0 || req.row_end() < req.row_begin() || req.row_end() > ve - vb)
      return absl::OutOfRangeError("rows outside the slice");
    v1::HeadGradientsChunk c;
    c.set_row_begin(req.row_begin());
    std::vector<float> w, b;
    for (int64_t r = req.row_begin(); r < req.row_end(); ++r) {
      for (int64_t k = 0; k < kH; ++k) w.push_back(static_cast<float>(1000 * (vb + r) + k));
      b.push_back(-static_cast<float>(vb + r));
    }
    if (short_weight && !w.empty()) w.pop_back();
    c.set_weight(std::string(reinterpret_cast<const char*>(w.data()), w.size() * sizeof(float)));
    c.set_bias(std::string(reinterpret_cast<const char*>(b.data()), b.size() * sizeof(float)));
    c.set_head(head);
    c.set_head_version("v1");
    c.set_vocab_size(ve - vb);
    c.set_hidden_size(hidden_size);
    c.set_micro_batches(2);
    c.set_tokens(17);
    c.set_has_bias(true);
    return c;
  }

  const int W_;
};

class HeadGradientsRead : public ::testing::Test {
 protected:
  void SetUp() override {
    LmHeadVersion v;
    v.head = "policy";
    v.version = "v1";
    v.source.dtype = v1::F32;
    v.source.vocab_size = kV;
    v.source.hidden_size = kH;
    v.sha256 = KnownSha256("ab12");
    v.origin = "test";
    ASSERT_TRUE(heads_.Add(v).ok());
  }

  /// Reads `begin`, `end` of step "run/step-1" through `fake` in pieces of
  /// `piece_bytes`; the pieces into `pieces`.
  absl::Status Read(FakeSteps& fake, int64_t begin, int64_t end, int64_t piece_bytes,
                    std::vector<v1::HeadGradientsChunk>* pieces, const std::string& head = "") {
    v1::ReadHeadGradientsRequest req;
    req.set_gradient_step("run/step-1");
    req.set_head(head);
    req.set_row_begin(begin);
    req.set_row_end(end);
    req.set_max_piece_bytes(piece_bytes);
    return ReadHeadGradients(heads_, fake.workers(), req, [pieces](const v1::HeadGradientsChunk& c) {
      pieces->push_back(c);
      return true;
    });
  }

  LmHeads heads_{LmHeads::Options{}};
};

/// Checks that `pieces` cover rows [begin, end) in order, with global
/// row_begin, V, at most `max_rows` rows each and none across a slice of W,
/// with the fake's values.
void ExpectPieces(const std::vector<v1::HeadGradientsChunk>& pieces, int64_t begin, int64_t end, int64_t max_rows,
                  int W) {
  int64_t at = begin;
  for (const v1::HeadGradientsChunk& c : pieces) {
    EXPECT_EQ(c.row_begin(), at);
    EXPECT_EQ(c.vocab_size(), kV) << "the head's V, not the slice's";
    EXPECT_EQ(c.hidden_size(), kH);
    EXPECT_TRUE(c.has_bias());
    EXPECT_EQ(c.micro_batches(), 2);
    const int64_t rows = static_cast<int64_t>(c.bias().size() / sizeof(float));
    EXPECT_GE(rows, 1);
    EXPECT_LE(rows, max_rows);
    ASSERT_EQ(c.weight().size(), static_cast<size_t>(rows * kH) * sizeof(float));
    int rank = 0;
    while (SplitRange(kV, W, rank).second <= at) ++rank;
    EXPECT_LE(at + rows, SplitRange(kV, W, rank).second) << "a piece within one worker's slice";
    std::vector<float> w(rows * kH), b(rows);
    std::memcpy(w.data(), c.weight().data(), c.weight().size());
    std::memcpy(b.data(), c.bias().data(), c.bias().size());
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(b[r], -static_cast<float>(at + r));
      for (int64_t k = 0; k < kH; ++k) EXPECT_EQ(w[r * kH + k], static_cast<float>(1000 * (at + r) + k));
    }
    at += rows;
  }
  EXPECT_EQ(at, end);
}

TEST_F(HeadGradientsRead, PiecesComeInRowOrderWithGlobalRowsAcrossSlices) {
  FakeSteps fake(3);  // slices [0, 4), [4, 7), [7, 10)
  std::vector<v1::HeadGradientsChunk> pieces;
  const int64_t two_rows = 2 * 4 * (kH + 1);
  ASSERT_TRUE(Read(fake, 1, 9, two_rows, &pieces).ok());
  ExpectPieces(pieces, 1, 9, 2, 3);
  // Asked slice-local rows of the slices' owners, in rank order.
  ASSERT_EQ(fake.calls.size(), 5u);
  const std::vector<std::vector<int64_t>> want = {{0, 1, 3}, {0, 3, 4}, {1, 0, 2}, {1, 2, 3}, {2, 0, 2}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(fake.calls[i].rank, want[i][0]) << i;
    EXPECT_EQ(fake.calls[i].begin, want[i][1]) << i;
    EXPECT_EQ(fake.calls[i].end, want[i][2]) << i;
  }
}

TEST_F(HeadGradientsRead, EveryRowByDefaultAndPieceSizes) {
  for (int W : {1, 2, 3, 4}) {
    for (int64_t piece_bytes : {int64_t{0}, int64_t{1}, 3 * 4 * (kH + 1) + 5, int64_t{64} << 20}) {
      SCOPED_TRACE(::testing::Message() << W << " workers, pieces of " << piece_bytes << " bytes");
      FakeSteps fake(W);
      std::vector<v1::HeadGradientsChunk> pieces;
      ASSERT_TRUE(Read(fake, 0, 0, piece_bytes, &pieces).ok());
      const int64_t rows = piece_bytes == 1 ? 1 : piece_bytes == 3 * 4 * (kH + 1) + 5 ? 3 : kV;
      ExpectPieces(pieces, 0, kV, rows, W);
    }
  }
}

TEST_F(HeadGradientsRead, AnEmptyRangeAsksRankZeroOnce) {
  for (int64_t at : {int64_t{4}, kV}) {
    FakeSteps fake(3);
    std::vector<v1::HeadGradientsChunk> pieces;
    ASSERT_TRUE(Read(fake, at, at, 0, &pieces).ok());
    ASSERT_EQ(fake.calls.size(), 1u);
    EXPECT_EQ(fake.calls[0].rank, 0);
    EXPECT_EQ(fake.calls[0].begin, 0);
    EXPECT_EQ(fake.calls[0].end, 0);
    ASSERT_EQ(pieces.size(), 1u);
    EXPECT_TRUE(pieces[0].weight().empty());
    EXPECT_TRUE(pieces[0].has_bias());
    EXPECT_EQ(pieces[0].micro_batches(), 2);
    EXPECT_EQ(pieces[0].vocab_size(), kV);
  }
}

TEST_F(HeadGradientsRead, Errors) {
  std::vector<v1::HeadGradientsChunk> pieces;
  {
    FakeSteps fake(3);
    fake.head = "reference";
    const absl::Status st = Read(fake, 0, 0, 0, &pieces);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("accumulates head 'reference', not 'policy'"), std::string::npos) << st;
  }
  for (const auto& [b, e] : {std::pair<int64_t, int64_t>{0, kV + 1}, {-1, 2}, {5, 3}, {kV + 1, kV + 1}}) {
    FakeSteps fake(3);
    const absl::Status st = Read(fake, b, e, 0, &pieces);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b << ", " << e << ": " << st;
    EXPECT_NE(st.message().find("outside the head's [0, V = 10]"), std::string::npos) << st;
    EXPECT_TRUE(fake.calls.empty());
  }
  for (int64_t piece_bytes : {int64_t{-1}, (int64_t{64} << 20) + 1}) {
    FakeSteps fake(3);
    EXPECT_EQ(Read(fake, 0, 0, piece_bytes, &pieces).code(), absl::StatusCode::kInvalidArgument);
  }
  {
    FakeSteps fake(3);
    EXPECT_EQ(Read(fake, 0, 0, 0, &pieces, "nope").code(), absl::StatusCode::kNotFound) << "an unknown head";
    EXPECT_TRUE(fake.calls.empty());
  }
  {
    FakeSteps fake(3);
    fake.error = absl::NotFoundError("gradient step 'run/step-1': no backward has added to it");
    EXPECT_EQ(Read(fake, 0, 0, 0, &pieces).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(fake.calls.size(), 1u) << "the first error ends the read";
  }
  {
    FakeSteps fake(3);
    fake.hidden_size = kH + 1;
    EXPECT_EQ(Read(fake, 0, 0, 0, &pieces).code(), absl::StatusCode::kInternal);
  }
  {
    FakeSteps fake(3);
    fake.short_weight = true;
    EXPECT_EQ(Read(fake, 0, 0, 0, &pieces).code(), absl::StatusCode::kInternal);
  }
  {
    FakeSteps fake(3);
    v1::ReadHeadGradientsRequest req;
    req.set_gradient_step("bad key");
    EXPECT_EQ(ReadHeadGradients(heads_, fake.workers(), req, [](const v1::HeadGradientsChunk&) { return true; }).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(fake.calls.empty());
  }
  {
    FakeSteps fake(3);
    v1::ReadHeadGradientsRequest req;
    req.set_gradient_step("run/step-1");
    int written = 0;
    const absl::Status st = ReadHeadGradients(heads_, fake.workers(), req, [&](const v1::HeadGradientsChunk&) {
      ++written;
      return false;
    });
    EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
    EXPECT_EQ(written, 1) << "no piece after the caller went";
  }
}

TEST(HeadGradientsClose, ChecksTheKeyAndClosesOnTheWorkers) {
  FakeSteps fake(3);
  v1::CloseHeadGradientStepRequest req;
  req.set_gradient_step("run/step-1");
  EXPECT_TRUE(CloseHeadGradientStep(fake.workers(), req).ok());
  EXPECT_EQ(fake.closed, std::vector<std::string>{"run/step-1"});
  fake.close_status = absl::UnavailableError("worker rank 1: gone");
  EXPECT_EQ(CloseHeadGradientStep(fake.workers(), req).code(), absl::StatusCode::kUnavailable);
  req.set_gradient_step("");
  EXPECT_EQ(CloseHeadGradientStep(fake.workers(), req).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fake.closed.size(), 2u) << "a malformed key reaches no worker";
}

}  // namespace
}  // namespace logprob
