// libFuzzer target: request validation (server/core/score_job.h) and work
// planning (server/core/planner.h).
//
// Each input is used twice: parsed as a serialized logprob.v1.ScoreRequest
// (when it parses), and decoded by StructuredRequest(), which spends the
// bytes on choices (logits or hidden states, padded or packed, dims,
// dtypes, ids, cu_seqlens / seq_lens, gather_indices, options, broken
// shapes) so that mutations reach the checks after "parse failed" and after
// "data size does not match". Each request goes through BuildScoreJob with
// two limit sets and with and without an lm_head shape; every job that
// validates is checked for its invariants and planned for 1..3 workers in
// every parallelism, and every plan is checked against the job. The same
// request with its hidden states as a CUDA IPC reference (and the parsed
// request's own references) goes through ResolveInputs (server/inputs/request_inputs.h),
// BuildScoreJob (every input row) and PlanWork, checked against the job of
// scored rows. A violated invariant traps.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/input_kind.h"
#include "google/protobuf/stubs/logging.h"
#include "logprob/v1/logprob.pb.h"
#include "server/core/planner.h"
#include "server/core/score_job.h"
#include "server/inputs/cuda_ipc_inputs.h"
#include "server/inputs/request_inputs.h"

namespace {

using logprob::LmHeadShape;
using logprob::Parallelism;
using logprob::RequestLimits;
using logprob::ScoreJob;
using logprob::v1::ScoreRequest;
using logprob::v1::Tensor;
namespace iv1 = logprob::internal::v1;

#define CHECK(cond)                                                                                    \
  do {                                                                                                 \
    if (!(cond)) {                                                                                     \
      std::fprintf(stderr, "fuzz_score_request: invariant violated: %s (line %d)\n", #cond, __LINE__); \
      __builtin_trap();                                                                                \
    }                                                                                                  \
  } while (0)

// ---- structured requests ------------------------------------------------

constexpr int64_t kLmHeadV = 64, kLmHeadH = 16;

// A dimension: mostly small, sometimes any int64 or a large power of two.
int64_t Dim(FuzzedDataProvider& p, int64_t typical) {
  const uint8_t s = p.ConsumeIntegral<uint8_t>();
  if (s < 224) return s % (typical + 1);
  if (s < 236) return p.ConsumeIntegral<int64_t>();
  return int64_t{1} << p.ConsumeIntegralInRange<int>(0, 62);
}

// a + b, wrapping (the harness builds broken shapes on purpose).
int64_t Add(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b)); }

logprob::DType PickDType(FuzzedDataProvider& p, bool want_float) {
  const uint8_t s = p.ConsumeIntegral<uint8_t>();
  if (s < 240) {
    static const logprob::DType kFloat[] = {logprob::v1::F32, logprob::v1::BF16, logprob::v1::F16};
    static const logprob::DType kInt[] = {logprob::v1::I64, logprob::v1::I32};
    return want_float ? kFloat[s % 3] : kInt[s % 2];
  }
  return static_cast<logprob::DType>(p.ConsumeIntegralInRange<int>(-1, 7));
}

float PickFloat(FuzzedDataProvider& p) {
  switch (p.ConsumeIntegralInRange<int>(0, 8)) {
    case 0:
      return 1.0f;
    case 1:
      return 0.5f;
    case 2:
      return 0.0f;
    case 3:
      return -1.0f;
    case 4:
      return std::numeric_limits<float>::quiet_NaN();
    case 5:
      return std::numeric_limits<float>::infinity();
    case 6:
      return 1.5f;
    case 7:
      return std::numeric_limits<float>::denorm_min();
    default:
      return p.ConsumeFloatingPoint<float>();
  }
}

// An id near [0, V): in range, ignore_index, just outside, or anything.
int64_t PickId(FuzzedDataProvider& p, int64_t V, int64_t ignore) {
  const uint8_t s = p.ConsumeIntegral<uint8_t>();
  if (s < 200) return V > 0 ? s % V : 0;
  if (s < 220) return ignore;
  if (s < 230) return -1;
  if (s < 240) return V;
  return p.ConsumeIntegral<int64_t>();
}

// Element count of `shape` if it is non-negative and at most `cap`, else -1.
int64_t SmallNumel(const Tensor& t, int64_t cap) {
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) return -1;
    if (d == 0) return 0;
  }
  for (int64_t d : t.shape()) {
    if (d > cap || n > cap / d) return -1;
    n *= d;
  }
  return n;
}

void PutInt(Tensor* t, size_t i, int64_t v) {
  char* at = &(*t->mutable_data())[0];
  switch (logprob::DTypeSize(t->dtype())) {
    case 2: {
      const int16_t w = static_cast<int16_t>(v);
      std::memcpy(at + i * 2, &w, 2);
      break;
    }
    case 4: {
      const int32_t w = static_cast<int32_t>(v);
      std::memcpy(at + i * 4, &w, 4);
      break;
    }
    case 8:
      std::memcpy(at + i * 8, &v, 8);
      break;
    default:
      break;
  }
}

// Sizes t's data for its shape and dtype (mostly), filling it with bytes
// from the front of the input; returns the element count (or -1).
int64_t FillData(FuzzedDataProvider& p, Tensor* t) {
  const size_t es = logprob::DTypeSize(t->dtype());
  const int64_t n = SmallNumel(*t, 1 << 14);
  size_t bytes = n >= 0 ? static_cast<size_t>(n) * (es ? es : 4) : p.ConsumeIntegralInRange<size_t>(0, 64);
  if (p.ConsumeIntegral<uint8_t>() >= 250) bytes += p.ConsumeIntegralInRange<int>(-3, 3);  // off by a few
  if (bytes > (size_t{1} << 20)) bytes = 0;
  std::string data = p.ConsumeBytesAsString(bytes);
  data.resize(bytes, '\0');
  t->set_data(std::move(data));
  return es && t->data().size() == static_cast<size_t>(n) * es ? n : -1;
}

Tensor* AddTensor(ScoreRequest* r, const char* name, logprob::DType dtype, std::vector<int64_t> shape) {
  Tensor* t = r->add_inputs();
  t->set_name(name);
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  return t;
}

ScoreRequest StructuredRequest(FuzzedDataProvider& p) {
  ScoreRequest r;
  const uint32_t f = p.ConsumeIntegral<uint32_t>();
  const bool hidden = f & 1, packed = f & 2, next = !(f & 4);

  logprob::v1::ScoreOptions* o = r.mutable_options();
  if (!next) o->set_alignment(logprob::v1::SAME_POSITION);
  if ((f & 0x300) == 0x300) o->set_alignment(static_cast<logprob::v1::Alignment>(p.ConsumeIntegral<int32_t>()));
  o->set_entropy(f & 8);
  const uint8_t k = p.ConsumeIntegral<uint8_t>();
  o->set_topk(k < 200 ? k % 10 : p.ConsumeIntegral<int32_t>());
  if (f & 0x10) o->set_temperature(PickFloat(p));
  if (f & 0x20) o->set_sampling_top_p(PickFloat(p));
  if (f & 0x40) o->set_sampling_top_k(p.ConsumeIntegralInRange<int32_t>(-2, 100));
  int64_t ignore = -100;
  if (f & 0x80) {
    static const int64_t kIgnore[] = {-100, -1, 0, 3, 63};
    const uint8_t s = p.ConsumeIntegral<uint8_t>();
    ignore = s < 250 ? kIgnore[s % 5] : p.ConsumeIntegral<int64_t>();
    o->set_ignore_index(ignore);
  }

  const int64_t last = hidden ? (p.ConsumeIntegral<uint8_t>() < 240 ? kLmHeadH : Dim(p, 20)) : Dim(p, 8);
  const int64_t V = hidden ? kLmHeadV : last;
  const int64_t B = Dim(p, 4), S = Dim(p, 6), T = Dim(p, 12);
  std::vector<int64_t> rows_shape = packed ? std::vector<int64_t>{T} : std::vector<int64_t>{B, S};

  // The rows: logits or hidden states (or both, or neither).
  const char* input_name = hidden ? "hidden_states" : "logits";
  if ((f & 0xc00) != 0xc00) {
    std::vector<int64_t> shape = rows_shape;
    shape.push_back(last);
    if ((f & 0x7000) == 0x7000) shape.pop_back();  // a dim short
    FillData(p, AddTensor(&r, input_name, PickDType(p, true), shape));
  }
  if ((f & 0xc00) == 0x800)
    FillData(p, AddTensor(&r, hidden ? "logits" : "hidden_states", PickDType(p, true), {1, 1, last}));

  // input_ids.
  if (!(f & 0x8000) || (f & 0x7000) != 0x6000) {
    Tensor* ids = AddTensor(&r, "input_ids", PickDType(p, false), rows_shape);
    const int64_t n = FillData(p, ids);
    for (int64_t i = 0; i < n && p.remaining_bytes() > 0; ++i)
      PutInt(ids, static_cast<size_t>(i), PickId(p, V, ignore));
  }

  // cu_seqlens for packed rows (usually), seq_lens for padded ones.
  if (packed ? !(f & 0x10000) : (f & 0x10000)) {
    const int64_t nb = Dim(p, 4);
    Tensor* cu = AddTensor(&r, "cu_seqlens", PickDType(p, false), {Add(nb, 1)});
    const int64_t n = FillData(p, cu);
    if (n > 0) {
      // Mostly a valid partition of T, with the odd step taken at random.
      int64_t at = 0;
      for (int64_t i = 1; i < n; ++i) {
        const int64_t left = static_cast<int64_t>(static_cast<uint64_t>(T) - static_cast<uint64_t>(at)), parts = n - i;
        const uint8_t s = p.ConsumeIntegral<uint8_t>();
        int64_t step = parts == 1 ? left : (left > 0 ? static_cast<int64_t>(s % (static_cast<uint64_t>(left) + 1)) : 0);
        if (s >= 245) step = p.ConsumeIntegral<int64_t>();
        at = static_cast<int64_t>(static_cast<uint64_t>(at) + static_cast<uint64_t>(step));  // may wrap
        PutInt(cu, static_cast<size_t>(i), at);
      }
      if (p.ConsumeIntegral<uint8_t>() >= 250) PutInt(cu, 0, p.ConsumeIntegral<int64_t>());
    }
  }
  if (packed ? (f & 0x20000) : (f & 0x20000) && !(f & 0x10000)) {
    Tensor* lens = AddTensor(&r, "seq_lens", PickDType(p, false), {packed ? T : B});
    const int64_t n = FillData(p, lens);
    for (int64_t i = 0; i < n && p.remaining_bytes() > 0; ++i)
      PutInt(lens, static_cast<size_t>(i), p.ConsumeIntegralInRange<int64_t>(-1, S >= 0 && S < 64 ? S + 1 : 64));
  }

  // gather_indices shaped like the output plus [K].
  if (f & 0x40000) {
    std::vector<int64_t> shape;
    if (packed) {
      shape.push_back(Dim(p, 12));
    } else {
      shape = {B, next ? Add(S, -1) : S};
    }
    shape.push_back(Dim(p, 4));
    Tensor* g = AddTensor(&r, "gather_indices", PickDType(p, false), shape);
    const int64_t n = FillData(p, g);
    for (int64_t i = 0; i < n && p.remaining_bytes() > 0; ++i) PutInt(g, static_cast<size_t>(i), PickId(p, V, -1));
  }

  // The odd unknown or repeated tensor, or a dim set to anything.
  if ((f & 0x180000) == 0x180000) AddTensor(&r, p.ConsumeBool() ? "input_ids" : "labels", logprob::v1::I64, {});
  if ((f & 0x600000) == 0x600000 && r.inputs_size() > 0) {
    Tensor* t = r.mutable_inputs(p.ConsumeIntegralInRange<int>(0, r.inputs_size() - 1));
    if (t->shape_size() > 0) t->set_shape(p.ConsumeIntegralInRange<int>(0, t->shape_size() - 1), Dim(p, 8));
  }
  return r;
}

// ---- invariants ---------------------------------------------------------

const Tensor* FindInput(const ScoreRequest& req, const std::string& name) {
  for (const Tensor& t : req.inputs())
    if (t.name() == name) return &t;
  return nullptr;
}

void CheckJob(const ScoreRequest& req, const ScoreJob& job, const RequestLimits& limits, const LmHeadShape& head) {
  const int64_t V = job.vocab_size;
  CHECK(V > 0);
  CHECK(logprob::IsFloatDType(job.dtype));
  const Tensor* input = FindInput(req, job.hidden ? "hidden_states" : "logits");
  CHECK(input != nullptr);
  if (job.hidden) {
    CHECK(V == head.vocab_size && job.hidden_size == head.hidden_size && job.hidden_size > 0);
    CHECK(job.row_bytes == static_cast<size_t>(job.hidden_size) * logprob::DTypeSize(job.dtype));
  } else {
    CHECK(job.row_bytes == static_cast<size_t>(V) * logprob::DTypeSize(job.dtype));
  }
  CHECK(job.row_bytes > 0 && input->data().size() % job.row_bytes == 0);
  const int64_t input_rows = static_cast<int64_t>(input->data().size() / job.row_bytes);

  const int64_t n = job.num_rows();
  CHECK(n <= limits.max_tokens);
  CHECK(static_cast<int64_t>(job.targets.size()) == n);
  CHECK(static_cast<int64_t>(job.out_pos.size()) == n);
  CHECK(job.gather_k >= 0 && job.gather_k <= limits.max_topk);
  CHECK(job.gather_ids.size() == static_cast<size_t>(n) * static_cast<size_t>(job.gather_k));
  CHECK(job.out_shape.size() == 1 || job.out_shape.size() == 2);
  for (int64_t d : job.out_shape) CHECK(d >= 0);
  const int64_t outputs = job.num_outputs();
  CHECK(outputs >= n);
  CHECK(job.segments.size() == 1 && job.segments[0].first_row == 0);
  CHECK(job.segments[0].source->byte_size() == static_cast<int64_t>(input->data().size()));
  CHECK(job.batchable() && job.referenced_source() == nullptr);
  for (int64_t r = 0; r < n; ++r) {
    CHECK(job.rows[r] >= 0 && job.rows[r] < input_rows);
    CHECK(job.targets[r] >= -1 && job.targets[r] < V);
    CHECK(job.out_pos[r] >= 0 && job.out_pos[r] < outputs);
    if (r > 0) CHECK(job.out_pos[r] > job.out_pos[r - 1]);
  }
  for (int64_t g : job.gather_ids) CHECK(g >= 0 && g < V);

  const auto& o = job.options;
  CHECK(o.has_temperature() && o.temperature() > 0.f && std::isfinite(o.temperature()));
  CHECK(o.has_sampling_top_p() && o.sampling_top_p() > 0.f && o.sampling_top_p() <= 1.f);
  CHECK(o.has_ignore_index());
  CHECK(o.sampling_top_k() >= 0);
  CHECK(o.topk() >= 0 && o.topk() <= V && o.topk() <= limits.max_topk);
  CHECK(o.alignment() == logprob::v1::NEXT_TOKEN || o.alignment() == logprob::v1::SAME_POSITION);
}

// The bytes of scored row r, columns [vb, ve), from the request's tensor `input`.
std::string RowSlice(const std::string& input, const ScoreJob& job, int64_t r, int64_t vb, int64_t ve, size_t esize) {
  return input.substr(static_cast<size_t>(job.rows[r]) * job.row_bytes + vb * esize,
                      static_cast<size_t>(ve - vb) * esize);
}

void CheckCommon(const ScoreJob& job, const iv1::WorkItem& it, uint64_t job_id, int64_t row_begin) {
  CHECK(it.job_id() == job_id);
  CHECK(it.vocab_size() == job.vocab_size);
  CHECK(it.dtype() == job.dtype);
  CHECK(it.gather_k() == job.gather_k);
  CHECK(it.targets_size() == it.num_rows());
  CHECK(static_cast<int64_t>(it.gather_ids_size()) == it.num_rows() * job.gather_k);
  for (int64_t i = 0; i < it.num_rows(); ++i) CHECK(it.targets(i) == job.targets[row_begin + i]);
  for (int i = 0; i < it.gather_ids_size(); ++i)
    CHECK(it.gather_ids(i) == job.gather_ids[row_begin * job.gather_k + i]);
  CHECK(it.options().SerializeAsString() == job.options.SerializeAsString());
}

// A vocab-parallel or hidden-states item: all rows, the next vocab slice after *vocab_at.
void CheckVocabSlice(const ScoreJob& job, const logprob::PlannedItem& p, uint64_t job_id, int64_t* vocab_at) {
  const auto& it = p.item;
  CHECK(p.row_offset == 0 && it.num_rows() == job.num_rows());
  CheckCommon(job, it, job_id, 0);
  CHECK(it.vocab_begin() == *vocab_at && it.vocab_end() >= it.vocab_begin());
  *vocab_at = it.vocab_end();
}

void CheckPlan(const std::string& input, const ScoreJob& job, const logprob::Plan& plan, int workers, Parallelism par,
               uint64_t job_id) {
  const int64_t n = job.num_rows(), V = job.vocab_size;
  const size_t esize = logprob::DTypeSize(job.dtype);
  int last_worker = -1;
  for (const auto& p : plan.items) {
    CHECK(p.worker > last_worker && p.worker < workers);
    last_worker = p.worker;
    CHECK(p.item.layout() == plan.layout);
  }
  if (job.hidden) {
    CHECK(plan.layout == iv1::HIDDEN_STATES);
    CHECK(static_cast<int>(plan.items.size()) == workers);
    int64_t vocab_at = 0, row_at = 0;
    for (const auto& p : plan.items) {
      const auto& it = p.item;
      CheckVocabSlice(job, p, job_id, &vocab_at);
      CHECK(it.hidden_size() == job.hidden_size && it.payload_case() == iv1::WorkItem::kData);
      CHECK(it.data().size() % job.row_bytes == 0);
      const int64_t own = static_cast<int64_t>(it.data().size() / job.row_bytes);
      for (int64_t r = 0; r < own; ++r)
        CHECK(it.data().compare(r * job.row_bytes, job.row_bytes,
                                RowSlice(input, job, row_at + r, 0, job.hidden_size, esize)) == 0);
      row_at += own;
    }
    CHECK(vocab_at == V && row_at == n);
    return;
  }
  const bool vocab = par == Parallelism::kVocab || (par == Parallelism::kAuto && workers > 1 && n < workers);
  CHECK(plan.layout == (vocab ? iv1::VOCAB_PARALLEL : iv1::TOKEN_PARALLEL));
  if (!vocab) {
    int64_t row_at = 0;
    for (const auto& p : plan.items) {
      const auto& it = p.item;
      CHECK(p.row_offset == row_at && it.num_rows() > 0);
      CheckCommon(job, it, job_id, p.row_offset);
      CHECK(it.vocab_begin() == 0 && it.vocab_end() == V);
      CHECK(it.data().size() == static_cast<size_t>(it.num_rows()) * job.row_bytes);
      for (int64_t r = 0; r < it.num_rows(); ++r)
        CHECK(it.data().compare(r * job.row_bytes, job.row_bytes, RowSlice(input, job, row_at + r, 0, V, esize)) == 0);
      row_at += it.num_rows();
    }
    CHECK(row_at == n);
    return;
  }
  CHECK(static_cast<int>(plan.items.size()) == workers);
  int64_t vocab_at = 0;
  for (const auto& p : plan.items) {
    const auto& it = p.item;
    CheckVocabSlice(job, p, job_id, &vocab_at);
    const size_t slice = static_cast<size_t>(it.vocab_end() - it.vocab_begin()) * esize;
    CHECK(it.data().size() == static_cast<size_t>(n) * slice);
    for (int64_t r = 0; r < n; ++r)
      CHECK(it.data().compare(r * slice, slice, RowSlice(input, job, r, it.vocab_begin(), it.vocab_end(), esize)) == 0);
  }
  CHECK(vocab_at == V);
}

void Exercise(const ScoreRequest& req) {
  static const RequestLimits kLimits[] = {RequestLimits{}, RequestLimits{64, 8}};
  static const LmHeadShape kHeads[] = {LmHeadShape{}, LmHeadShape{kLmHeadV, kLmHeadH}};
  static const Parallelism kPar[] = {Parallelism::kAuto, Parallelism::kToken, Parallelism::kVocab};
  for (const RequestLimits& limits : kLimits) {
    for (const LmHeadShape& head : kHeads) {
      absl::StatusOr<ScoreJob> job = logprob::BuildScoreJob(req, limits, head);
      if (!job.ok()) {
        const absl::StatusCode c = job.status().code();
        CHECK(c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kFailedPrecondition);
        CHECK(!job.status().message().empty());
        continue;
      }
      CheckJob(req, *job, limits, head);
      const std::string& input = FindInput(req, job->hidden ? "hidden_states" : "logits")->data();
      uint64_t id = 1;
      for (int workers = 1; workers <= 3; ++workers)
        for (Parallelism par : kPar) {
          const logprob::Plan plan = logprob::PlanWork(*job, workers, par, id);
          CheckPlan(input, *job, plan, workers, par, id);
          ++id;
        }
    }
  }
}

// Largest CUDA IPC tensor exercised (a job of every input row allocates per row).
constexpr int64_t kMaxIpcBytes = int64_t{1} << 20;
// The reference ByCudaIpc writes.
constexpr int64_t kIpcOffset = 64;

/// `scored` (the job of the same tensor as bytes) against `all` (its
/// CUDA IPC job): every input row, the scored ones with their target,
/// output position and gather ids, the others unscored.
void CheckIpcJob(const ScoreJob& scored, const ScoreJob& all, int64_t byte_size) {
  CHECK(all.referenced_source() != nullptr && !all.batchable());
  CHECK(all.row_bytes == scored.row_bytes && all.row_bytes > 0);
  const int64_t n = byte_size / static_cast<int64_t>(all.row_bytes);
  CHECK(all.num_rows() == n && static_cast<int64_t>(all.targets.size()) == n &&
        static_cast<int64_t>(all.out_pos.size()) == n);
  CHECK(static_cast<int64_t>(all.gather_ids.size()) == n * all.gather_k && all.out_shape == scored.out_shape);
  for (int64_t r = 0; r < n; ++r) CHECK(all.rows[r] == r);
  int64_t unscored = 0;
  for (int64_t r = 0; r < n; ++r) unscored += all.out_pos[r] < 0 ? 1 : 0;
  CHECK(unscored == n - scored.num_rows());
  for (int64_t j = 0; j < scored.num_rows(); ++j) {
    const int64_t r = scored.rows[j];
    CHECK(r >= 0 && r < n);
    CHECK(all.targets[r] == scored.targets[j] && all.out_pos[r] == scored.out_pos[j]);
    for (int k = 0; k < scored.gather_k; ++k)
      CHECK(all.gather_ids[r * all.gather_k + k] == scored.gather_ids[j * scored.gather_k + k]);
  }
}

/// The plan of a CUDA IPC job: one HIDDEN_STATES item per worker, no bytes,
/// the workers' ranges tiling the tensor's bytes in order.
void CheckIpcPlan(const ScoreJob& job, const logprob::Plan& plan, int workers, int64_t offset) {
  CHECK(plan.layout == iv1::HIDDEN_STATES && static_cast<int>(plan.items.size()) == workers);
  CHECK(plan.payload_region == nullptr);
  int64_t at = offset;
  for (const auto& p : plan.items) {
    const auto& it = p.item;
    CHECK(it.has_cuda_ipc());
    CHECK(it.cuda_ipc().handle() == std::string(logprob::kCudaIpcHandleBytes, 'h'));
    CHECK(it.cuda_ipc().offset() == at && it.cuda_ipc().byte_size() >= 0);
    CHECK(it.cuda_ipc().byte_size() % static_cast<int64_t>(job.row_bytes) == 0);
    CHECK(it.num_rows() == job.num_rows());
    at += it.cuda_ipc().byte_size();
  }
  CHECK(at == offset + job.num_rows() * static_cast<int64_t>(job.row_bytes));
}

/// `req` as ScoringService::ScoreOne takes a CUDA IPC input, on a server
/// that can serve it.
void ExerciseCudaIpc(const ScoreRequest& req) {
  logprob::InputContext context;
  context.cuda_ipc = logprob::CudaIpcAvailability{true, true, true, true, 1, "gloo"};
  context.peer = "ipv4:127.0.0.1:1";
  auto inputs = logprob::ResolveInputs(req, context);
  if (!inputs.ok()) {
    const absl::StatusCode c = inputs.status().code();
    CHECK(c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kFailedPrecondition);
    CHECK(!inputs.status().message().empty());
    return;
  }
  int ipc = -1;
  for (int i = 0; i < req.inputs_size(); ++i)
    if (inputs->sources[i]->kind() == logprob::InputKind::kCudaIpc) {
      CHECK(req.inputs(i).name() == "hidden_states" && ipc < 0);
      ipc = i;
    } else {
      CHECK(inputs->sources[i]->kind() == logprob::InputKind::kBytes);
    }
  if (ipc < 0 || inputs->sources[ipc]->byte_size() > kMaxIpcBytes) return;
  const int64_t byte_size = inputs->sources[ipc]->byte_size();
  CHECK(req.inputs(ipc).cuda_ipc().handle().size() == logprob::kCudaIpcHandleBytes && byte_size >= 0);
  // The same tensor as bytes: the job of the scored rows only.
  logprob::RequestInputs as_bytes = *inputs;
  const std::string zeros(static_cast<size_t>(byte_size), '\0');
  as_bytes.sources[ipc] = logprob::MemorySource(zeros);
  static const RequestLimits kLimits[] = {RequestLimits{}, RequestLimits{64, 8}};
  for (const RequestLimits& limits : kLimits) {
    const LmHeadShape head{kLmHeadV, kLmHeadH};
    absl::StatusOr<ScoreJob> all = logprob::BuildScoreJob(req, limits, head, &*inputs);
    absl::StatusOr<ScoreJob> scored = logprob::BuildScoreJob(req, limits, head, &as_bytes);
    CHECK(all.ok() == scored.ok());
    if (!all.ok()) continue;
    CHECK(all->hidden);
    CheckIpcJob(*scored, *all, byte_size);
    for (int workers = 1; workers <= 3; ++workers)
      CheckIpcPlan(*all, logprob::PlanWork(*all, workers, Parallelism::kAuto, 1), workers,
                   req.inputs(ipc).cuda_ipc().offset());
  }
}

/// `req` with its hidden states (if any, inline) replaced by a reference.
ScoreRequest ByCudaIpc(const ScoreRequest& req) {
  ScoreRequest out = req;
  for (Tensor& t : *out.mutable_inputs())
    if (t.name() == "hidden_states" && logprob::KindOf(t) == logprob::InputKind::kBytes) {
      const auto bytes = static_cast<int64_t>(t.data().size());
      t.mutable_cuda_ipc()->set_handle(std::string(logprob::kCudaIpcHandleBytes, 'h'));
      t.mutable_cuda_ipc()->set_offset(kIpcOffset);
      t.mutable_cuda_ipc()->set_byte_size(bytes);
    }
  return out;
}

// FUZZ_DUMP=1 prints each structured request (to read a crash input).
bool g_dump = false;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // no "invalid UTF-8" lines per input
  g_dump = std::getenv("FUZZ_DUMP") != nullptr;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    ScoreRequest req;
    if (req.ParseFromArray(data, static_cast<int>(size))) {
      Exercise(req);
      ExerciseCudaIpc(req);
    }
  }
  FuzzedDataProvider p(data, size);
  const ScoreRequest req = StructuredRequest(p);
  if (g_dump) std::fprintf(stderr, "structured request: %s\n", req.ShortDebugString().c_str());
  Exercise(req);
  ExerciseCudaIpc(ByCudaIpc(req));
  return 0;
}
