// The worker's scorer (worker/scoring/scorer.h) on W in-process ranks
// (tests/in_process_communicator.h) with the CPU backend: every layout
// (token-parallel, vocab-parallel, hidden states), with and without the
// sampling filters, with entropy, log_sum_sq_probs, mean_logits, is_top1,
// top-k and gathered outputs, for W = 1, 2
// and 3 ranks, against a float64 reference computed here (shared/SPEC.md
// tolerance 2e-4 + 2e-5 * |expected|; top-k ids exact). Threads and
// condition variables only: no processes, no sockets, no sleeps.
#include "worker/scoring/scorer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "common/partition.h"
#include "tests/fake_device_copy.h"
#include "tests/in_process_communicator.h"
#include "tests/random_values.h"
#include "worker/comm/host_staged_device_collectives.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/kernels/sampling_filter.h"
#include "worker/scoring/cpu_backend.h"
#include "worker/scoring/one_pass_layout.h"

namespace logprob::testing {
namespace {

using internal::v1::Layout;
using internal::v1::WorkItem;
using internal::v1::WorkResult;
constexpr double kInf = std::numeric_limits<double>::infinity();

/// A job's rows as the scorer sees them (already validated and planned):
/// x = logits / temperature in float32, or hidden states times an lm_head.
struct Problem {
  DType dtype = v1::F32;         // of `logits`, or of `hidden` and `lm_head`
  int64_t n = 0, V = 0, H = 0;   // rows, vocabulary, hidden size (hidden only)
  std::vector<char> logits;      // [n, V] of dtype (logits problems)
  std::vector<char> hidden;      // [n, H] of dtype (hidden problems)
  std::vector<char> lm_head;     // [V, H] of dtype (hidden problems)
  std::vector<int64_t> targets;  // [n], -1 = ignored
  int gather_k = 0;
  std::vector<int64_t> gather_ids;  // [n, gather_k]
  v1::ScoreOptions options;
  bool is_hidden() const { return !hidden.empty(); }
};

/// Element `i` of a float buffer of `dtype` (F32 or BF16).
double ValueAt(DType dtype, const std::vector<char>& buf, int64_t i) {
  if (dtype == v1::BF16) {
    uint16_t b;
    std::memcpy(&b, buf.data() + 2 * i, 2);
    return Bf16ToFloat(b);
  }
  float f;
  std::memcpy(&f, buf.data() + 4 * i, 4);
  return f;
}

/// Targets in [0, V) with every 7th row ignored; gather ids in [0, V).
void RandomIds(Problem& p, std::mt19937& rng) {
  p.targets.resize(p.n);
  for (int64_t i = 0; i < p.n; ++i) p.targets[i] = i % 7 == 3 ? -1 : static_cast<int64_t>(rng() % p.V);
  p.gather_ids.resize(p.n * p.gather_k);
  for (auto& g : p.gather_ids) g = static_cast<int64_t>(rng() % p.V);
}

// ---------------------------------------------------------------------------
// float64 reference (shared/SPEC.md "Outputs", "Filters", with the top-p tie
// rule: values equal to the smallest kept value are kept).

struct RefRow {
  double token = 0, entropy = 0;
  double log_sum_sq = 0, mean = 0;  // 0 without a target
  int top1 = 0;
  double top1_gap = kInf;  // |x_target - max of the other x|: how clear is_top1 is
  std::vector<double> topk_lp, gathered;
  std::vector<int64_t> topk_id;
  std::vector<double> logp;  // [V]
};

/// x: the row after temperature. The filters as shared/SPEC.md states them
/// on values: top-k keeps x >= k-th largest; top-p keeps a value when the
/// probability mass of strictly larger kept values is < p (so all copies
/// of a value share its fate), the largest always.
RefRow Reference(const std::vector<double>& x, int64_t target, const int64_t* gather, int gather_k,
                 const v1::ScoreOptions& o) {
  const size_t V = x.size();
  std::vector<bool> keep(V, true);
  const int top_k = o.sampling_top_k();
  if (top_k > 0 && static_cast<size_t>(top_k) < V) {
    std::vector<double> s = x;
    std::nth_element(s.begin(), s.begin() + (top_k - 1), s.end(), std::greater<double>());
    for (size_t i = 0; i < V; ++i) keep[i] = x[i] >= s[top_k - 1];
  }
  const double p = o.has_sampling_top_p() ? o.sampling_top_p() : 1.0;
  if (p > 0 && p < 1) {
    double mx = -kInf, z = 0;
    for (size_t i = 0; i < V; ++i)
      if (keep[i]) mx = std::max(mx, x[i]);
    for (size_t i = 0; i < V; ++i)
      if (keep[i]) z += std::exp(x[i] - mx);
    std::vector<bool> kept = keep;
    for (size_t i = 0; i < V; ++i) {
      if (!keep[i] || x[i] == mx) continue;
      double above = 0;
      for (size_t j = 0; j < V; ++j)
        if (keep[j] && x[j] > x[i]) above += std::exp(x[j] - mx);
      kept[i] = above / z < p;
    }
    keep = kept;
  }
  double mx = -kInf, s = 0;
  for (size_t i = 0; i < V; ++i)
    if (keep[i]) mx = std::max(mx, x[i]);
  for (size_t i = 0; i < V; ++i)
    if (keep[i]) s += std::exp(x[i] - mx);
  const double log_z = mx + std::log(s);
  RefRow r;
  r.logp.resize(V);
  for (size_t i = 0; i < V; ++i) {
    r.logp[i] = keep[i] ? x[i] - log_z : -kInf;
    if (keep[i]) r.entropy -= std::exp(r.logp[i]) * r.logp[i];
  }
  r.token = target >= 0 ? r.logp[target] : 0.0;
  if (target >= 0) {
    double sq = 0, sum = 0, other = -kInf;
    size_t argmax = 0;
    for (size_t i = 0; i < V; ++i) {
      if (keep[i]) sq += std::exp(2 * r.logp[i]);
      sum += x[i];
      if (x[i] > x[argmax]) argmax = i;  // the lowest id among equal maxima
      if (static_cast<int64_t>(i) != target) other = std::max(other, x[i]);
    }
    r.log_sum_sq = std::log(sq);
    r.mean = sum / static_cast<double>(V);
    r.top1 = static_cast<int64_t>(argmax) == target ? 1 : 0;
    r.top1_gap = std::abs(x[target] - other);
  }
  std::vector<int64_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return r.logp[a] > r.logp[b]; });
  for (int k = 0; k < o.topk(); ++k) {
    r.topk_id.push_back(order[k]);
    r.topk_lp.push_back(r.logp[order[k]]);
  }
  for (int k = 0; k < gather_k; ++k) r.gathered.push_back(r.logp[gather[k]]);
  return r;
}

/// The row `i` of `p` after temperature, as float64: logits rows are
/// divided in float32 (as the service does); hidden rows are the exact
/// float64 product with the lm_head, then divided.
std::vector<double> RowAfterTemperature(const Problem& p, int64_t i) {
  const float t = p.options.has_temperature() ? p.options.temperature() : 1.0f;
  std::vector<double> x(p.V);
  for (int64_t v = 0; v < p.V; ++v) {
    if (p.is_hidden()) {
      double dot = 0;
      for (int64_t h = 0; h < p.H; ++h)
        dot += ValueAt(p.dtype, p.hidden, i * p.H + h) * ValueAt(p.dtype, p.lm_head, v * p.H + h);
      x[v] = dot / t;
    } else {
      x[v] = static_cast<float>(static_cast<float>(ValueAt(p.dtype, p.logits, i * p.V + v)) / t);
    }
  }
  return x;
}

// ---------------------------------------------------------------------------
// Running the scorer on W in-process ranks.

/// The outputs of every row of a problem, gathered from the ranks' results.
struct Scored {
  std::vector<float> token, entropy, topk_lp, gathered, log_sum_sq, mean;
  std::vector<int64_t> topk_id;
  std::vector<int32_t> top1;
};

/// The work item of rank `r` of `W` for `layout` (what the front-end's
/// planner sends: whole rows SplitRange(n, W, r) for token-parallel; every
/// row's vocabulary slice SplitRange(V, W, r) for vocab-parallel; the
/// hidden states of rows SplitRange(n, W, r) for hidden states).
WorkItem ItemFor(const Problem& p, Layout layout, int W, int r) {
  WorkItem item;
  item.set_layout(layout);
  item.set_dtype(p.dtype);
  item.set_vocab_size(p.V);
  item.set_gather_k(p.gather_k);
  *item.mutable_options() = p.options;
  const size_t es = DTypeSize(p.dtype);
  const auto [rb, re] = SplitRange(p.n, W, r);
  const auto [vb, ve] = SplitRange(p.V, W, r);
  int64_t first = 0, rows = p.n;
  if (layout == internal::v1::TOKEN_PARALLEL) {
    first = rb;
    rows = re - rb;
    item.set_vocab_begin(0);
    item.set_vocab_end(p.V);
    item.set_data(p.logits.data() + first * p.V * es, rows * p.V * es);
  } else {
    item.set_vocab_begin(vb);
    item.set_vocab_end(ve);
    if (layout == internal::v1::VOCAB_PARALLEL) {
      std::string slice;
      for (int64_t i = 0; i < p.n; ++i) slice.append(p.logits.data() + (i * p.V + vb) * es, (ve - vb) * es);
      item.set_data(slice);
    } else {
      item.set_hidden_size(p.H);
      item.set_data(p.hidden.data() + rb * p.H * es, (re - rb) * p.H * es);
    }
  }
  item.set_num_rows(rows);
  for (int64_t i = first; i < first + rows; ++i) {
    item.add_targets(p.targets[i]);
    for (int k = 0; k < p.gather_k; ++k) item.add_gather_ids(p.gather_ids[i * p.gather_k + k]);
  }
  return item;
}

/// Rank r's CPU backend and, for hidden states, its lm_head rows SplitRange(V, W, r).
struct RankBackend {
  std::unique_ptr<ScoringBackend> backend;
  std::shared_ptr<const LmHeadWeights> lm_head;
};
RankBackend BackendFor(const Problem& p, int W, int r) {
  RankBackend rb{std::make_unique<CpuBackend>(/*threads=*/1), nullptr};
  if (!p.is_hidden()) return rb;
  const auto [vb, ve] = SplitRange(p.V, W, r);
  const size_t row = static_cast<size_t>(p.H) * DTypeSize(p.dtype);
  std::vector<char> slice(p.lm_head.begin() + vb * row, p.lm_head.begin() + ve * row);
  auto loaded = rb.backend->LoadLmHead(LmHeadSlice{p.dtype, std::move(slice), ve - vb, p.H}, LmHeadPrecision::kAuto);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  if (loaded.ok()) rb.lm_head = *std::move(loaded);
  return rb;
}

/// The one-pass contract (ScoringBackend::HiddenItemPartials) on the host,
/// as the CUDA backend implements it on the device, with the same
/// arithmetic (worker/scoring/one_pass_layout.h): passes of `pass_rows` rows of
/// every rank's share, an agreement before each pass, an all-gather of
/// every rank's rows into aligned slots, the inner backend's records for
/// the pass's rows (rank order), one all-to-all of records, scattered into
/// [W][rows][words]. Its collectives are the device ones, as the CUDA
/// backend's (RunRanks gives it HostStagedDeviceCollectives with "device
/// memory" in host memory, the Gloo staging of CUDA workers). Everything
/// else is forwarded.
class HostOnePassBackend final : public ScoringBackend {
 public:
  explicit HostOnePassBackend(std::unique_ptr<ScoringBackend> inner, int64_t pass_rows = 7)
      : inner_(std::move(inner)), pass_rows_(pass_rows) {}
  std::string name() const override { return "host-one-pass"; }
  absl::Status SlicePartials(const LogitsBlock& b, const BlockRows& r, const kernels::StatsSpec& s,
                             uint32_t* out) override {
    return inner_->SlicePartials(b, r, s, out);
  }
  absl::Status FilteredRowPartials(const LogitsBlock& b, const BlockRows& r, const kernels::StatsSpec& s,
                                   const SamplingFilter& f, uint32_t* out) override {
    return inner_->FilteredRowPartials(b, r, s, f, out);
  }
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice slice,
                                                                  LmHeadPrecision precision) override {
    return inner_->LoadLmHead(std::move(slice), precision);
  }
  absl::Status HiddenPartials(const LmHeadWeights& w, DType d, const void* h, int64_t vb, const BlockRows& r,
                              const kernels::StatsSpec& s, uint32_t* out) override {
    return inner_->HiddenPartials(w, d, h, vb, r, s, out);
  }
  absl::Status HiddenLogits(const LmHeadWeights& w, DType d, const void* h, int64_t M, float* out) override {
    return inner_->HiddenLogits(w, d, h, M, out);
  }
  bool OnePassHidden(const Communicator&) const override { return true; }
  absl::Status HiddenItemPartials(const LmHeadWeights& lm_head, const HiddenItemRows& item, Communicator& comm,
                                  const kernels::StatsSpec& spec, uint32_t* own_records) override {
    ++one_pass_calls;
    const int W = comm.size(), me = comm.rank();
    RankRows ranks{item.first, item.count};
    if (absl::Status st = CheckRankRows(ranks, W, item.rows.count); !st.ok()) return st;
    const size_t row = static_cast<size_t>(lm_head.hidden_size()) * DTypeSize(item.dtype);
    const size_t words = kernels::PartialWords(spec);
    const OnePassLayout layout(std::move(ranks), pass_rows_);
    for (int64_t p = 0; p < layout.passes(); ++p) {
      const bool stop = item.should_stop && item.should_stop();
      if (auto agreed = AgreeOnPass(comm, stop ? PassVote::kCancelled : PassVote::kGo, pass_rows_, absl::OkStatus());
          !agreed.ok())
        return agreed.status();
      ++passes;
      const PassLayout pass = layout.Pass(p);
      std::vector<char> slot(pass.SlotBytes(row)), all(W * pass.SlotBytes(row)), packed;
      if (pass.count[me])
        std::memcpy(slot.data(), static_cast<const char*>(item.own) + pass.pass_row0 * row, pass.count[me] * row);
      if (absl::Status st = comm.AllGatherDevice(slot.data(), slot.size(), all.data()); !st.ok()) return st;
      for (int q = 0; q < W; ++q) {
        const char* from = all.data() + pass.SlotOffset(q, row);
        packed.insert(packed.end(), from, from + pass.count[q] * row);
      }
      // The pass's targets in pass order (rank q's from record_row[q]).
      std::vector<int64_t> targets, gather;
      for (int q = 0; q < W; ++q) {
        const int64_t f = pass.item_first[q], c = pass.count[q], k = spec.gather_k;
        targets.insert(targets.end(), item.rows.targets + f, item.rows.targets + f + c);
        if (k) gather.insert(gather.end(), item.rows.gather_ids + f * k, item.rows.gather_ids + (f + c) * k);
      }
      const BlockRows ids{pass.total(), targets.data(), spec.gather_k ? gather.data() : nullptr};
      std::vector<uint32_t> records(static_cast<size_t>(pass.total()) * words);
      if (absl::Status st =
              inner_->HiddenPartials(lm_head, item.dtype, packed.data(), item.vocab_begin, ids, spec, records.data());
          !st.ok())
        return st;
      std::vector<int64_t> send, recv;
      pass.RecordExchange(me, words, &send, &recv);
      std::vector<uint32_t> got(static_cast<size_t>(W * pass.count[me]) * words);
      if (absl::Status st = comm.AllToAllVDevice(records.data(), send, got.data(), recv); !st.ok()) return st;
      if (pass.count[me] > 0)  // `got` is empty (its data() may be null) when this rank has no rows here
        for (int q = 0; q < W; ++q)
          std::memcpy(own_records + RecordIndex(q, pass.pass_row0, item.count[me], words),
                      got.data() + RecordIndex(q, 0, pass.count[me], words), pass.count[me] * words * 4);
    }
    return absl::OkStatus();
  }
  int passes = 0;
  int one_pass_calls = 0;

 private:
  std::unique_ptr<ScoringBackend> inner_;
  int64_t pass_rows_;
};

/// Runs ScoreWorkItem for every rank on its own thread; `should_stop`
/// (optional) is given rank r's index. A rank that fails aborts the group
/// so the others do not wait for it. Returns the per-rank results.
std::vector<absl::StatusOr<WorkResult>> RunRanks(const Problem& p, Layout layout, int W,
                                                 int64_t hidden_chunk_tokens = 16,
                                                 const std::function<bool(int rank)>& should_stop = {},
                                                 bool one_pass = false) {
  InProcessGroup group(W);
  std::vector<absl::StatusOr<WorkResult>> results(W, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      const WorkItem item = ItemFor(p, layout, W, r);
      RankBackend rb = BackendFor(p, W, r);
      std::unique_ptr<ScoringBackend> backend = std::move(rb.backend);
      if (one_pass) backend = std::make_unique<HostOnePassBackend>(std::move(backend));
      // One-pass backends take device collectives: staged through host
      // memory as for CUDA workers over Gloo.
      std::unique_ptr<Communicator> comm = std::make_unique<InProcessCommunicator>(group, r);
      if (one_pass)
        comm = std::make_unique<HostStagedDeviceCollectives>(std::move(comm), std::make_unique<FakeDeviceCopy>());
      std::function<bool()> stop;
      if (should_stop) stop = [&should_stop, r] { return should_stop(r); };
      // Token-parallel items run alone in the worker (SelfCommunicator).
      SelfCommunicator self;
      Communicator& c = layout == internal::v1::TOKEN_PARALLEL ? static_cast<Communicator&>(self) : *comm;
      results[r] = ScoreWorkItem(item, c, *backend, hidden_chunk_tokens, stop, rb.lm_head.get());
      if (!results[r].ok()) group.Abort();
      if (one_pass && layout == internal::v1::HIDDEN_STATES && p.options.sampling_top_k() == 0 &&
          !p.options.has_sampling_top_p()) {
        EXPECT_EQ(static_cast<HostOnePassBackend&>(*backend).one_pass_calls, 1) << "rank " << r;
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

/// Scores `p` on W ranks and assembles every row's outputs (fails the
/// test on a rank error).
Scored Score(const Problem& p, Layout layout, int W, bool one_pass = false) {
  const auto results = RunRanks(p, layout, W, 16, {}, one_pass);
  const int K = p.options.topk(), G = p.gather_k;
  Scored s;
  s.token.assign(p.n, NAN);
  s.entropy.assign(p.n, NAN);
  s.log_sum_sq.assign(p.n, NAN);
  s.mean.assign(p.n, NAN);
  s.top1.assign(p.n, -1);
  s.topk_lp.assign(p.n * K, NAN);
  s.topk_id.assign(p.n * K, -1);
  s.gathered.assign(p.n * G, NAN);
  for (int r = 0; r < W; ++r) {
    if (!results[r].ok()) {
      ADD_FAILURE() << "rank " << r << ": " << results[r].status();
      continue;
    }
    const WorkResult& res = *results[r];
    // Token-parallel results count from the item's first row.
    const int64_t offset = layout == internal::v1::TOKEN_PARALLEL ? SplitRange(p.n, W, r).first : 0;
    const auto [own_b, own_e] = SplitRange(p.n, W, r);
    EXPECT_EQ(res.row_begin() + offset, own_b) << "rank " << r;
    EXPECT_EQ(res.row_end() + offset, own_e) << "rank " << r;
    for (int64_t i = res.row_begin(); i < res.row_end(); ++i) {
      const int64_t row = i + offset, local = i - res.row_begin();
      s.token[row] = res.token_logprobs(static_cast<int>(local));
      if (p.options.entropy()) s.entropy[row] = res.entropy(static_cast<int>(local));
      if (p.options.log_sum_sq_probs()) s.log_sum_sq[row] = res.log_sum_sq_probs(static_cast<int>(local));
      if (p.options.mean_logits()) s.mean[row] = res.mean_logits(static_cast<int>(local));
      if (p.options.is_top1()) s.top1[row] = res.is_top1(static_cast<int>(local));
      for (int k = 0; k < K; ++k) {
        s.topk_lp[row * K + k] = res.topk_logprobs(static_cast<int>(local * K + k));
        s.topk_id[row * K + k] = res.topk_indices(static_cast<int>(local * K + k));
      }
      for (int k = 0; k < G; ++k) s.gathered[row * G + k] = res.gathered_logprobs(static_cast<int>(local * G + k));
    }
  }
  return s;
}

bool Close(double expected, double got) {
  if (std::isinf(expected)) return expected == got;
  return std::abs(expected - got) <= 2e-4 + 2e-5 * std::abs(expected);
}

/// Compares every output of `s` with the float64 reference; at most a few
/// failures are reported. Top-k ids must match exactly, except that for
/// hidden states (float32 GEMM against float64) two candidates whose
/// reference logprobs are within tolerance may come in either order.
void ExpectMatchesReference(const Problem& p, const Scored& s, const std::string& what) {
  SCOPED_TRACE(what);
  const int K = p.options.topk(), G = p.gather_k;
  int bad = 0;
  auto check = [&](bool ok, const std::string& msg) {
    if (!ok && bad++ < 8) ADD_FAILURE() << msg;
  };
  for (int64_t i = 0; i < p.n; ++i) {
    const RefRow ref = Reference(RowAfterTemperature(p, i), p.targets[i], p.gather_ids.data() + i * G, G, p.options);
    const std::string row = "row " + std::to_string(i);
    check(Close(ref.token, s.token[i]),
          row + " token_logprob: expected " + std::to_string(ref.token) + " got " + std::to_string(s.token[i]));
    if (p.options.entropy())
      check(Close(ref.entropy, s.entropy[i]),
            row + " entropy: expected " + std::to_string(ref.entropy) + " got " + std::to_string(s.entropy[i]));
    if (p.options.log_sum_sq_probs())
      check(Close(ref.log_sum_sq, s.log_sum_sq[i]), row + " log_sum_sq_probs: expected " +
                                                        std::to_string(ref.log_sum_sq) + " got " +
                                                        std::to_string(s.log_sum_sq[i]));
    if (p.options.mean_logits())
      check(Close(ref.mean, s.mean[i]),
            row + " mean_logits: expected " + std::to_string(ref.mean) + " got " + std::to_string(s.mean[i]));
    // Hidden states: a float32 GEMM against float64 may swap a near-tie.
    if (p.options.is_top1() && (!p.is_hidden() || ref.top1_gap > 1e-3))
      check(ref.top1 == s.top1[i],
            row + " is_top1: expected " + std::to_string(ref.top1) + " got " + std::to_string(s.top1[i]));
    for (int k = 0; k < K; ++k) {
      const int64_t id = s.topk_id[i * K + k];
      const std::string at = row + " top-k " + std::to_string(k);
      check(Close(ref.topk_lp[k], s.topk_lp[i * K + k]), at + ": expected logprob " + std::to_string(ref.topk_lp[k]) +
                                                             " got " + std::to_string(s.topk_lp[i * K + k]));
      if (p.is_hidden()) {
        check(id >= 0 && id < p.V && Close(ref.logp[id], ref.topk_lp[k]),
              at + ": id " + std::to_string(id) + " is not a candidate of the reference");
      } else {
        check(id == ref.topk_id[k],
              at + ": expected id " + std::to_string(ref.topk_id[k]) + " got " + std::to_string(id));
      }
    }
    for (int k = 0; k < G; ++k)
      check(Close(ref.gathered[k], s.gathered[i * G + k]), row + " gathered " + std::to_string(k) + ": expected " +
                                                               std::to_string(ref.gathered[k]) + " got " +
                                                               std::to_string(s.gathered[i * G + k]));
  }
}

/// Expects `a` and `b` (the same problem on different rank counts) to
/// agree within the SPEC tolerance, top-k ids exactly.
void ExpectSameScores(const Scored& a, const Scored& b, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.token.size(), b.token.size());
  int bad = 0;
  auto close_all = [&](const std::vector<float>& x, const std::vector<float>& y, const char* name) {
    for (size_t i = 0; i < x.size(); ++i)
      if (!(std::isnan(x[i]) && std::isnan(y[i])) && !Close(x[i], y[i]) && bad++ < 8)
        ADD_FAILURE() << name << "[" << i << "]: " << x[i] << " vs " << y[i];
  };
  close_all(a.token, b.token, "token_logprobs");
  close_all(a.entropy, b.entropy, "entropy");
  close_all(a.topk_lp, b.topk_lp, "topk_logprobs");
  close_all(a.gathered, b.gathered, "gathered_logprobs");
  close_all(a.log_sum_sq, b.log_sum_sq, "log_sum_sq_probs");
  close_all(a.mean, b.mean, "mean_logits");
  EXPECT_EQ(a.topk_id, b.topk_id);
  EXPECT_EQ(a.top1, b.top1);
}

/// Asks for log_sum_sq_probs, mean_logits and is_top1, and makes every 5th
/// scored target of a logits problem the argmax of its row (the lowest id
/// among equal maxima, x as the service computes it) so is_top1 is 1 there.
void AskForExtras(Problem& p) {
  p.options.set_log_sum_sq_probs(true);
  p.options.set_mean_logits(true);
  p.options.set_is_top1(true);
  if (p.is_hidden()) return;
  for (int64_t i = 0; i < p.n; i += 5) {
    if (p.targets[i] < 0) continue;
    const std::vector<double> x = RowAfterTemperature(p, i);
    p.targets[i] = std::max_element(x.begin(), x.end()) - x.begin();
  }
}

/// A logits problem: n rows over V of `dtype`, entropy, top-k 5, 3
/// gathered ids, log_sum_sq_probs, mean_logits and is_top1 (AskForExtras),
/// optionally temperature 0.7 with top-k 40 and top-p 0.9.
Problem LogitsProblem(DType dtype, int64_t n, int64_t V, bool filters, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.dtype = dtype;
  p.n = n;
  p.V = V;
  p.logits = RandomValues(dtype, n * V, 2.0f, rng);
  p.gather_k = 3;
  RandomIds(p, rng);
  p.options.set_entropy(true);
  p.options.set_topk(5);
  if (filters) {
    p.options.set_temperature(0.7f);
    p.options.set_sampling_top_k(40);
    p.options.set_sampling_top_p(0.9f);
  }
  AskForExtras(p);
  return p;
}

/// A hidden-states problem: bf16 hidden [n, H] and lm_head [V, H].
Problem HiddenProblem(int64_t n, int64_t V, int64_t H, bool filters, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.dtype = v1::BF16;
  p.n = n;
  p.V = V;
  p.H = H;
  p.hidden = RandomValues(v1::BF16, n * H, 1.0f, rng);
  p.lm_head = RandomValues(v1::BF16, V * H, 0.3f, rng);
  p.gather_k = 2;
  RandomIds(p, rng);
  p.options.set_entropy(true);
  p.options.set_topk(4);
  if (filters) {
    p.options.set_temperature(1.3f);
    p.options.set_sampling_top_k(30);
    p.options.set_sampling_top_p(0.8f);
  }
  AskForExtras(p);
  return p;
}

const char* LayoutName(Layout l) {
  return l == internal::v1::TOKEN_PARALLEL ? "token" : l == internal::v1::VOCAB_PARALLEL ? "vocab" : "hidden";
}

// ---------------------------------------------------------------------------

TEST(InProcessCommunicator, AllGatherAndAllToAllVMoveTheRightBytes) {
  constexpr int W = 3;
  InProcessGroup group(W);
  std::vector<std::vector<int>> gathered(W), exchanged(W);
  std::vector<absl::Status> status(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      InProcessCommunicator comm(group, r);
      const int mine[2] = {10 * r, 10 * r + 1};
      gathered[r].resize(2 * W);
      status[r] = comm.AllGather(mine, sizeof mine, gathered[r].data());
      // Rank r sends q + 1 ints to rank q, each 100 * r + q.
      std::vector<int> send;
      std::vector<int64_t> send_bytes(W), recv_bytes(W);
      for (int q = 0; q < W; ++q) {
        for (int k = 0; k <= q; ++k) send.push_back(100 * r + q);
        send_bytes[q] = (q + 1) * 4;
        recv_bytes[q] = (r + 1) * 4;
      }
      exchanged[r].resize(W * (r + 1));
      if (status[r].ok()) status[r] = comm.AllToAllV(send.data(), send_bytes, exchanged[r].data(), recv_bytes);
      if (status[r].ok()) {
        EXPECT_EQ(comm.collectives(), 2);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < W; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_EQ(gathered[r], (std::vector<int>{0, 1, 10, 11, 20, 21}));
    std::vector<int> want;
    for (int q = 0; q < W; ++q)
      for (int k = 0; k <= r; ++k) want.push_back(100 * q + r);
    EXPECT_EQ(exchanged[r], want) << "rank " << r;
  }
}

TEST(InProcessCommunicator, MismatchedSizesAndAbortAreErrorsNotHangs) {
  InProcessGroup group(2);
  absl::Status a, b;
  std::thread t0([&] {
    InProcessCommunicator comm(group, 0);
    int x = 1, out[2];
    a = comm.AllGather(&x, sizeof x, out);
  });
  std::thread t1([&] {
    InProcessCommunicator comm(group, 1);
    int64_t y = 2, out[2];
    b = comm.AllGather(&y, sizeof y, out);
  });
  t0.join();
  t1.join();
  EXPECT_EQ(a.code(), absl::StatusCode::kInvalidArgument) << a;
  EXPECT_EQ(b.code(), absl::StatusCode::kInvalidArgument) << b;

  // A rank that fails before a collective aborts the group: the peer's
  // collective returns UNAVAILABLE instead of waiting for it.
  InProcessGroup second(2);
  absl::Status waiting;
  std::thread peer([&] {
    InProcessCommunicator comm(second, 1);
    char c = 0, out[2];
    waiting = comm.AllGather(&c, 1, out);
  });
  second.Abort();
  peer.join();
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable) << waiting;
}

struct LayoutCase {
  Layout layout;
  DType dtype;
  bool filters;
};

class ScorerLayouts : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(ScorerLayouts, EveryRankCountMatchesFloat64AndOneRank) {
  const LayoutCase c = GetParam();
  // 300 rows: vocab-parallel and hidden-states run several collective
  // rounds (128 rows; 16 hidden rows per rank); V not divisible by 2 or 3.
  const Problem p = c.layout == internal::v1::HIDDEN_STATES ? HiddenProblem(150, 301, 64, c.filters, 11)
                                                            : LogitsProblem(c.dtype, 300, 1001, c.filters, 7);
  const std::string name = std::string(LayoutName(c.layout)) + (c.filters ? " with filters" : "");
  const Scored one = Score(p, c.layout, 1);
  ExpectMatchesReference(p, one, name + ", W=1");
  for (int W : {2, 3}) {
    const Scored many = Score(p, c.layout, W);
    ExpectMatchesReference(p, many, name + ", W=" + std::to_string(W));
    ExpectSameScores(one, many, name + ", W=1 against W=" + std::to_string(W));
  }
}

INSTANTIATE_TEST_SUITE_P(AllLayouts, ScorerLayouts,
                         ::testing::Values(LayoutCase{internal::v1::TOKEN_PARALLEL, v1::F32, false},
                                           LayoutCase{internal::v1::TOKEN_PARALLEL, v1::BF16, true},
                                           LayoutCase{internal::v1::VOCAB_PARALLEL, v1::F32, false},
                                           LayoutCase{internal::v1::VOCAB_PARALLEL, v1::BF16, false},
                                           LayoutCase{internal::v1::VOCAB_PARALLEL, v1::F32, true},
                                           LayoutCase{internal::v1::VOCAB_PARALLEL, v1::BF16, true},
                                           LayoutCase{internal::v1::HIDDEN_STATES, v1::BF16, false},
                                           LayoutCase{internal::v1::HIDDEN_STATES, v1::BF16, true}),
                         [](const ::testing::TestParamInfo<LayoutCase>& info) {
                           return std::string(LayoutName(info.param.layout)) + "_" + DTypeName(info.param.dtype) +
                                  (info.param.filters ? "_filters" : "");
                         });

TEST(Scorer, VocabParallelResultsAreBitwiseTheSameWhoeverFinalisesTheRow) {
  // The partials of a row are combined in rank order whichever rank owns
  // it, so W = 2 gives the same bits for every row (worker/scoring/scorer.h).
  const Problem p = LogitsProblem(v1::F32, 10, 257, false, 3);
  const Scored a = Score(p, internal::v1::VOCAB_PARALLEL, 2);
  Problem q = p;
  // The same rows in reverse order: each row is finalised by the other rank.
  const size_t row = static_cast<size_t>(p.V) * 4;
  for (int64_t i = 0; i < p.n; ++i) {
    std::memcpy(q.logits.data() + i * row, p.logits.data() + (p.n - 1 - i) * row, row);
    q.targets[i] = p.targets[p.n - 1 - i];
    for (int k = 0; k < p.gather_k; ++k)
      q.gather_ids[i * p.gather_k + k] = p.gather_ids[(p.n - 1 - i) * p.gather_k + k];
  }
  const Scored b = Score(q, internal::v1::VOCAB_PARALLEL, 2);
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t j = p.n - 1 - i;
    EXPECT_EQ(std::memcmp(&a.token[i], &b.token[j], 4), 0) << "row " << i;
    EXPECT_EQ(std::memcmp(&a.entropy[i], &b.entropy[j], 4), 0) << "row " << i;
    EXPECT_EQ(std::memcmp(&a.log_sum_sq[i], &b.log_sum_sq[j], 4), 0) << "row " << i;
    EXPECT_EQ(std::memcmp(&a.mean[i], &b.mean[j], 4), 0) << "row " << i;
    EXPECT_EQ(a.top1[i], b.top1[j]) << "row " << i;
  }
}

TEST(Scorer, HiddenStatesInOnePassGiveTheBitsOfTheRounds) {
  // A backend that scores the whole item in one pass (the CUDA backend's
  // contract, here on the host) gives every row the same bits as rounds of
  // 16 rows, for W = 1..3, and rows split unevenly or not at all (n < W).
  // The double runs passes of 7 rows per rank (worker/scoring/one_pass_layout.h,
  // the CUDA backend's arithmetic), so 150 rows take several passes.
  for (int64_t n : {150, 37, 2}) {
    const Problem p = HiddenProblem(n, 301, 64, /*filters=*/false, 21);
    for (int W : {1, 2, 3, 5, 8}) {
      SCOPED_TRACE("n " + std::to_string(n) + " W " + std::to_string(W));
      const Scored rounds = Score(p, internal::v1::HIDDEN_STATES, W);
      const Scored one = Score(p, internal::v1::HIDDEN_STATES, W, /*one_pass=*/true);
      ExpectMatchesReference(p, one, "one pass");
      EXPECT_EQ(std::memcmp(rounds.token.data(), one.token.data(), 4 * n), 0);
      EXPECT_EQ(std::memcmp(rounds.entropy.data(), one.entropy.data(), 4 * n), 0);
      EXPECT_EQ(std::memcmp(rounds.log_sum_sq.data(), one.log_sum_sq.data(), 4 * n), 0);
      EXPECT_EQ(std::memcmp(rounds.mean.data(), one.mean.data(), 4 * n), 0);
      EXPECT_EQ(rounds.top1, one.top1);
      EXPECT_EQ(rounds.topk_id, one.topk_id);
      EXPECT_EQ(std::memcmp(rounds.topk_lp.data(), one.topk_lp.data(), 4 * rounds.topk_lp.size()), 0);
      EXPECT_EQ(std::memcmp(rounds.gathered.data(), one.gathered.data(), 4 * rounds.gathered.size()), 0);
    }
  }
}

TEST(Scorer, HiddenStatesWithSamplingFiltersKeepTheirRoundsOnAOnePassBackend) {
  // Filters need full rows (all_to_all_vp2sq): the scorer keeps the rounds.
  const Problem p = HiddenProblem(40, 301, 64, /*filters=*/true, 22);
  ExpectMatchesReference(p, Score(p, internal::v1::HIDDEN_STATES, 2, /*one_pass=*/true), "filters");
}

TEST(Scorer, DevicePayloadNeedsAOnePassBackend) {
  const Problem p = HiddenProblem(8, 64, 32, /*filters=*/false, 23);
  const WorkItem item = ItemFor(p, internal::v1::HIDDEN_STATES, 1, 0);
  RankBackend rb = BackendFor(p, 1, 0);
  SelfCommunicator self;
  const auto res =
      ScoreWorkItem(item, ItemPayload(item.data(), /*device=*/true), self, *rb.backend, 16, {}, rb.lm_head.get());
  EXPECT_EQ(res.status().code(), absl::StatusCode::kFailedPrecondition) << res.status();
  // Without the item's lm_head version: FAILED_PRECONDITION naming it.
  const auto none = ScoreWorkItem(item, self, *rb.backend, 16, {}, nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition) << none.status();
  const WorkItem logits = ItemFor(LogitsProblem(v1::F32, 4, 16, false, 2), internal::v1::TOKEN_PARALLEL, 1, 0);
  const auto bad = ScoreWorkItem(logits, ItemPayload(logits.data(), /*device=*/true), self, *rb.backend, 16, {});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

TEST(Scorer, OneRankAskingToStopStopsEveryRankAfterTheSameRound) {
  // Rank 1 asks to stop from its second round on; the ranks agree on it
  // (one all-gather per round), so all of them return CANCELLED and none
  // waits for a collective the others skipped.
  const Problem p = LogitsProblem(v1::F32, 400, 301, false, 5);
  for (Layout layout : {internal::v1::VOCAB_PARALLEL, internal::v1::HIDDEN_STATES}) {
    SCOPED_TRACE(LayoutName(layout));
    const Problem q = layout == internal::v1::HIDDEN_STATES ? HiddenProblem(100, 64, 32, false, 6) : p;
    std::atomic<int> polls{0};
    const auto results = RunRanks(q, layout, 2, 16, [&](int rank) { return rank == 1 && ++polls > 1; });
    for (const auto& r : results) EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  }
}

TEST(Scorer, OneRankAskingToStopStopsEveryRankAfterTheSameOnePassPass) {
  // The one-pass path polls should_stop once per pass and the ranks agree
  // (AgreeOnPass): rank 1 asks to stop from its third poll on (the
  // scorer's own check and the first pass go through), so every rank
  // returns CANCELLED after the same pass and none waits in a collective.
  const Problem p = HiddenProblem(100, 64, 32, /*filters=*/false, 6);
  std::atomic<int> polls{0};
  const auto results = RunRanks(
      p, internal::v1::HIDDEN_STATES, 3, 16, [&](int rank) { return rank == 1 && ++polls > 2; },
      /*one_pass=*/true);
  for (const auto& r : results) EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
}

TEST(Scorer, TopPBoundaryInsideAGroupOfEqualBf16LogitsKeepsTheWholeGroup) {
  // One bf16 row of V = 16: a top logit 2.0, six equal logits 1.0 (ids
  // 5..10, split between ranks for W = 2) and nine at -2.0. With top-p 0.5
  // the mass strictly above the group (the top: 0.297) is < 0.5, so the
  // whole group is kept (shared/SPEC.md: values equal to the smallest kept
  // value are kept). A rule that walks a sorted order one entry at a time
  // would keep only part of it, depending on how equal values are sorted.
  constexpr int64_t V = 16;
  std::vector<float> z(V, -2.0f);
  z[12] = 2.0f;
  for (int64_t v = 5; v <= 10; ++v) z[v] = 1.0f;
  const std::vector<int64_t> targets = {12, 5, 10, 0, -1};
  Problem p;
  p.dtype = v1::BF16;
  p.n = static_cast<int64_t>(targets.size());
  p.V = V;
  p.logits.resize(p.n * V * 2);
  for (int64_t i = 0; i < p.n; ++i)
    for (int64_t v = 0; v < V; ++v) {
      const uint16_t b = FloatToBf16(z[v]);
      std::memcpy(p.logits.data() + (i * V + v) * 2, &b, 2);
    }
  p.targets = targets;
  p.options.set_entropy(true);
  p.options.set_topk(8);
  p.options.set_sampling_top_p(0.5f);

  // Independent float64 expectations: the kept set is the top and the
  // whole group; the order-dependent rule (ascending cumsum > 1 - p,
  // entry by entry) would keep only 2 of the 6.
  const double e_top = std::exp(2.0), e_mid = std::exp(1.0), e_low = std::exp(-2.0);
  const double z_all = e_top + 6 * e_mid + 9 * e_low;
  int order_rule_keeps = 0;
  for (int k = 1; k <= 6; ++k)  // the group's members after the nine low ones, ascending
    order_rule_keeps += (9 * e_low + k * e_mid) / z_all > 0.5;
  ASSERT_EQ(order_rule_keeps, 2) << "the boundary must fall inside the group for this test to mean anything";
  const double log_z = std::log(e_top + 6 * e_mid);
  const double lp_top = 2.0 - log_z, lp_mid = 1.0 - log_z;
  const double entropy = -(std::exp(lp_top) * lp_top + 6 * std::exp(lp_mid) * lp_mid);
  const std::vector<double> want_token = {lp_top, lp_mid, lp_mid, -kInf, 0.0};
  const std::vector<int64_t> want_ids = {12, 5, 6, 7, 8, 9, 10, 0};  // -inf after the kept, lower id first

  for (Layout layout : {internal::v1::TOKEN_PARALLEL, internal::v1::VOCAB_PARALLEL}) {
    for (int W : {1, 2}) {
      SCOPED_TRACE(std::string(LayoutName(layout)) + ", W=" + std::to_string(W));
      const Scored s = Score(p, layout, W);
      for (int64_t i = 0; i < p.n; ++i) {
        EXPECT_TRUE(Close(want_token[i], s.token[i])) << "row " << i << ": " << s.token[i] << " vs " << want_token[i];
        EXPECT_TRUE(Close(entropy, s.entropy[i])) << "row " << i << ": " << s.entropy[i] << " vs " << entropy;
        for (int k = 0; k < 8; ++k) {
          EXPECT_EQ(s.topk_id[i * 8 + k], want_ids[k]) << "row " << i << " top-k " << k;
          const double want = k == 0 ? lp_top : k < 7 ? lp_mid : -kInf;
          EXPECT_TRUE(Close(want, s.topk_lp[i * 8 + k])) << "row " << i << " top-k " << k;
        }
      }
    }
  }
  // The kernel alone: the smallest kept value is the group's.
  std::vector<float> x(z.begin(), z.end()), scratch;
  EXPECT_EQ(kernels::SamplingKeepMin(x.data(), V, 0, 0.5f, &scratch), 1.0f);
}

}  // namespace
}  // namespace logprob::testing
