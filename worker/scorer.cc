#include "worker/scorer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/partition.h"
#include "worker/kernels/row_stats.h"
#include "worker/kernels/sampling_filter.h"

namespace logprob {
namespace {

using internal::v1::WorkItem;
using internal::v1::WorkResult;
using kernels::StatsSpec;

StatsSpec SpecOf(const WorkItem& item) {
  StatsSpec spec;
  const auto& o = item.options();
  spec.temperature = o.has_temperature() ? o.temperature() : 1.0f;
  spec.entropy = o.entropy();
  spec.topk = o.topk();
  spec.gather_k = item.gather_k();
  return spec;
}

bool HasFilters(const WorkItem& item) {
  const auto& o = item.options();
  return o.sampling_top_k() > 0 || (o.has_sampling_top_p() && o.sampling_top_p() < 1.0f);
}

/// Output arrays of the rows a rank returns, in WorkResult layout.
class ResultRows {
 public:
  ResultRows(const StatsSpec& spec, int64_t begin, int64_t end, WorkResult* res) : spec_(spec), res_(res) {
    const int64_t n = end - begin;
    res->set_row_begin(begin);
    res->set_row_end(end);
    res->mutable_token_logprobs()->Resize(static_cast<int>(n), 0.f);
    if (spec.entropy) res->mutable_entropy()->Resize(static_cast<int>(n), 0.f);
    res->mutable_topk_logprobs()->Resize(static_cast<int>(n * spec.topk), 0.f);
    res->mutable_topk_indices()->Resize(static_cast<int>(n * spec.topk), 0);
    res->mutable_gathered_logprobs()->Resize(static_cast<int>(n * spec.gather_k), 0.f);
  }
  /// Output pointers of local row `i` (0-based within this rank's rows).
  kernels::RowOutput At(int64_t i) {
    kernels::RowOutput o;
    o.token_logprob = res_->mutable_token_logprobs()->mutable_data() + i;
    if (spec_.entropy) o.entropy = res_->mutable_entropy()->mutable_data() + i;
    if (spec_.topk) {
      o.topk_logprobs = res_->mutable_topk_logprobs()->mutable_data() + i * spec_.topk;
      o.topk_indices = res_->mutable_topk_indices()->mutable_data() + i * spec_.topk;
    }
    if (spec_.gather_k) o.gathered = res_->mutable_gathered_logprobs()->mutable_data() + i * spec_.gather_k;
    return o;
  }

 private:
  StatsSpec spec_;
  WorkResult* res_;
};

/// Everything the per-row work shares.
struct Job {
  const WorkItem& item;
  StatsSpec spec;
  bool filters;
  const std::function<bool()>& should_stop;
  std::vector<uint32_t> record;
  std::vector<float> scratch = std::vector<float>(kernels::kPartialScratchFloats);
  std::vector<float> row_f32;
  std::vector<float> filter_scratch;

  /// Row `row` (global index in the item) of a slice held at `logits`.
  kernels::SliceRow Slice(const void* logits, int64_t row) const {
    kernels::SliceRow r;
    r.logits = logits;
    r.target = item.targets(static_cast<int>(row));
    r.gather_ids = spec.gather_k ? item.gather_ids().data() + row * spec.gather_k : nullptr;
    return r;
  }
};

/// Scores one full row (all V columns of `logits`, of `dtype`).
void ScoreFullRow(Job& job, DType dtype, const void* logits, int64_t row, const kernels::RowOutput& out) {
  const int64_t V = job.item.vocab_size();
  kernels::SliceRow r = job.Slice(logits, row);
  if (job.filters) {
    job.row_f32.resize(static_cast<size_t>(V));
    ToFloat(dtype, logits, static_cast<size_t>(V), job.row_f32.data());
    for (auto& x : job.row_f32) x = x / job.spec.temperature;
    const auto& o = job.item.options();
    r.keep_min = kernels::SamplingKeepMin(job.row_f32.data(), V, o.sampling_top_k(),
                                          o.has_sampling_top_p() ? o.sampling_top_p() : 1.0f,
                                          &job.filter_scratch);
  }
  job.record.resize(kernels::PartialWords(job.spec));
  kernels::ComputePartial(dtype, r, 0, V, job.spec, job.record.data(), job.scratch.data());
  const uint32_t* recs[1] = {job.record.data()};
  kernels::CombinePartials(recs, 1, job.spec, r.target >= 0, out);
}

/// The rows of one collective round, grouped by the rank that finalises
/// them: rank q's rows are global rows [first[q], first[q] + count[q]),
/// stored after those of ranks < q in the round's slice buffer.
struct RoundRows {
  std::vector<int64_t> first, count;
  explicit RoundRows(int W) : first(W, 0), count(W, 0) {}
  int64_t total() const {
    int64_t n = 0;
    for (int64_t c : count) n += c;
    return n;
  }
};

/// This rank's vocabulary slice of a round's rows: `data` holds
/// rows.total() rows of `len` elements of `dtype`, from global column `begin`.
struct RoundSlice {
  DType dtype;
  const char* data;
  int64_t begin, len;
  size_t row_bytes() const { return static_cast<size_t>(len) * DTypeSize(dtype); }
};

/// Finalises the rows this rank owns in one round. Without sampling
/// filters every rank computes the packed partial of every row on its
/// slice and one all-to-all brings each owner the partials of its rows
/// (combined in rank order, so results do not depend on who finalises).
/// With filters the all-to-all brings the owner full rows instead (NeMo-RL
/// `all_to_all_vp2sq`), because the filter threshold needs the whole row.
/// `out_row0` is the global index of the owner's first result row.
absl::Status FinishRound(Job& job, Communicator& comm, const RoundRows& rows, const RoundSlice& slice,
                         int64_t out_row0, ResultRows& out) {
  const int W = comm.size(), me = comm.rank();
  const int64_t V = job.item.vocab_size(), mine = rows.count[me];
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  if (!job.filters) {
    const size_t words = kernels::PartialWords(job.spec);
    std::vector<uint32_t> send(static_cast<size_t>(rows.total()) * words), recv(mine * W * words);
    size_t at = 0;
    for (int q = 0; q < W; ++q) {
      for (int64_t i = 0; i < rows.count[q]; ++i, ++at)
        kernels::ComputePartial(slice.dtype, job.Slice(slice.data + at * slice.row_bytes(), rows.first[q] + i),
                                slice.begin, slice.len, job.spec, send.data() + at * words, job.scratch.data());
      send_bytes[q] = rows.count[q] * static_cast<int64_t>(words) * 4;
      recv_bytes[q] = mine * static_cast<int64_t>(words) * 4;
    }
    if (auto st = comm.AllToAllV(send.data(), send_bytes, recv.data(), recv_bytes); !st.ok()) return st;
    std::vector<const uint32_t*> recs(W);
    for (int64_t i = 0; i < mine; ++i) {
      const int64_t row = rows.first[me] + i;
      for (int q = 0; q < W; ++q) recs[q] = recv.data() + (q * mine + i) * words;
      kernels::CombinePartials(recs.data(), W, job.spec, job.item.targets(static_cast<int>(row)) >= 0,
                               out.At(row - out_row0));
    }
    return absl::OkStatus();
  }
  const size_t esize = DTypeSize(slice.dtype);
  std::vector<int64_t> recv_off(W);
  int64_t total_recv = 0;
  for (int q = 0; q < W; ++q) {
    const auto [vb, ve] = SplitRange(V, W, q);
    send_bytes[q] = rows.count[q] * static_cast<int64_t>(slice.row_bytes());
    recv_bytes[q] = mine * (ve - vb) * static_cast<int64_t>(esize);
    recv_off[q] = total_recv;
    total_recv += recv_bytes[q];
  }
  std::vector<char> recv(static_cast<size_t>(std::max<int64_t>(total_recv, 1)));
  std::vector<char> full(static_cast<size_t>(V) * esize);
  if (auto st = comm.AllToAllV(slice.data, send_bytes, recv.data(), recv_bytes); !st.ok()) return st;
  for (int64_t i = 0; i < mine; ++i) {
    size_t at = 0;
    for (int q = 0; q < W; ++q) {
      const auto [vb, ve] = SplitRange(V, W, q);
      const size_t len = static_cast<size_t>(ve - vb) * esize;
      std::copy_n(recv.data() + recv_off[q] + i * len, len, full.data() + at);
      at += len;
    }
    const int64_t row = rows.first[me] + i;
    ScoreFullRow(job, slice.dtype, full.data(), row, out.At(row - out_row0));
  }
  return absl::OkStatus();
}

absl::Status Stopped() { return absl::CancelledError("stopped: the request was cancelled or its deadline passed"); }

/// Collective layouts: every rank says whether it must stop (one byte,
/// all-gathered), so all stop after the same round. OK to go on.
absl::Status AgreeToGoOn(Job& job, Communicator& comm) {
  if (!job.should_stop) return absl::OkStatus();
  const char mine = job.should_stop() ? 1 : 0;
  std::vector<char> all(comm.size());
  if (auto st = comm.AllGather(&mine, 1, all.data()); !st.ok()) return st;
  for (char c : all)
    if (c) return Stopped();
  return absl::OkStatus();
}

/// VOCAB_PARALLEL: rounds of kVocabParallelChunkRows rows of the item.
absl::Status ScoreLogitsSlices(Job& job, Communicator& comm, int64_t own_begin, ResultRows& out) {
  const WorkItem& item = job.item;
  const int W = comm.size();
  const RoundSlice all{item.dtype(), item.logits().data(), item.vocab_begin(), item.vocab_end() - item.vocab_begin()};
  for (int64_t c0 = 0; c0 < item.num_rows(); c0 += kVocabParallelChunkRows) {
    if (auto st = AgreeToGoOn(job, comm); !st.ok()) return st;
    const int64_t c1 = std::min(item.num_rows(), c0 + kVocabParallelChunkRows);
    RoundRows rows(W);
    for (int q = 0; q < W; ++q) {
      const auto [ob, oe] = SplitRange(item.num_rows(), W, q);
      rows.first[q] = std::max(c0, ob);
      rows.count[q] = std::max<int64_t>(0, std::min(c1, oe) - rows.first[q]);
    }
    RoundSlice slice = all;
    slice.data += c0 * slice.row_bytes();
    if (auto st = FinishRound(job, comm, rows, slice, own_begin, out); !st.ok()) return st;
  }
  return absl::OkStatus();
}

/// HIDDEN_STATES: per round every rank contributes up to chunk_tokens of
/// its hidden rows (one all-gather), multiplies all of them by its lm_head
/// slice and finishes the round like the logits path. Memory per round:
/// ~chunk_tokens * W rows of hidden states and of this rank's logits slice.
absl::Status ScoreHiddenStates(Job& job, Communicator& comm, const HiddenScoring& hidden, int64_t own_begin,
                               ResultRows& out) {
  const WorkItem& item = job.item;
  const int W = comm.size(), me = comm.rank();
  const int64_t n = item.num_rows(), H = item.hidden_size();
  const size_t hrow = static_cast<size_t>(H) * DTypeSize(item.dtype());
  const int64_t most = SplitRange(n, W, 0).second;  // rows of the largest share
  const int64_t per_round = std::max<int64_t>(1, hidden.chunk_tokens);
  std::vector<char> send, gathered;
  std::vector<float> logits;
  for (int64_t l0 = 0; l0 < most; l0 += per_round) {
    if (auto st = AgreeToGoOn(job, comm); !st.ok()) return st;
    const int64_t c = std::min(per_round, most - l0);  // padded rows per rank this round
    RoundRows rows(W);
    for (int q = 0; q < W; ++q) {
      const auto [ob, oe] = SplitRange(n, W, q);
      rows.first[q] = ob + l0;
      rows.count[q] = std::clamp<int64_t>(oe - ob - l0, 0, c);
    }
    send.assign(c * hrow, 0);
    std::copy_n(item.hidden_states().data() + l0 * hrow, rows.count[me] * hrow, send.data());
    gathered.resize(W * c * hrow);
    if (auto st = comm.AllGather(send.data(), send.size(), gathered.data()); !st.ok()) return st;
    // Drop the padding: rank q's rows follow rank q-1's.
    int64_t packed = 0;
    for (int q = 0; q < W; ++q) {
      std::memmove(gathered.data() + packed * hrow, gathered.data() + q * c * hrow, rows.count[q] * hrow);
      packed += rows.count[q];
    }
    logits.resize(static_cast<size_t>(packed * hidden.gemm->rows()));
    if (auto st = hidden.gemm->Compute(item.dtype(), gathered.data(), packed, logits.data()); !st.ok()) return st;
    const RoundSlice slice{v1::F32, reinterpret_cast<const char*>(logits.data()), item.vocab_begin(),
                           hidden.gemm->rows()};
    if (auto st = FinishRound(job, comm, rows, slice, own_begin, out); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<WorkResult> ScoreWorkItem(const WorkItem& item, Communicator& comm, const HiddenScoring* hidden,
                                         const std::function<bool()>& should_stop) {
  const auto t0 = std::chrono::steady_clock::now();
  Job job{item, SpecOf(item), HasFilters(item), should_stop};
  const DType dtype = item.dtype();
  if (!IsFloatDType(dtype)) return absl::InvalidArgumentError("work item: dtype must be F32, BF16 or F16");
  const int64_t n = item.num_rows();
  if (item.targets_size() != n || item.gather_ids_size() != n * item.gather_k())
    return absl::InvalidArgumentError("work item: targets or gather_ids size does not match num_rows");
  const size_t esize = DTypeSize(dtype);
  const int64_t slice_len = item.vocab_end() - item.vocab_begin();
  WorkResult res;
  if (item.layout() == internal::v1::TOKEN_PARALLEL) {
    if (item.vocab_begin() != 0 || slice_len != item.vocab_size())
      return absl::InvalidArgumentError("work item: token-parallel rows must be whole");
    if (static_cast<int64_t>(item.logits().size()) != n * slice_len * static_cast<int64_t>(esize))
      return absl::InvalidArgumentError("work item: logits size does not match num_rows");
    ResultRows rows(job.spec, 0, n, &res);
    for (int64_t row = 0; row < n; ++row) {
      if (row % kVocabParallelChunkRows == 0 && should_stop && should_stop()) return Stopped();
      ScoreFullRow(job, dtype, item.logits().data() + row * slice_len * esize, row, rows.At(row));
    }
  } else {
    const auto [vb, ve] = SplitRange(item.vocab_size(), comm.size(), comm.rank());
    if (vb != item.vocab_begin() || ve != item.vocab_end())
      return absl::InvalidArgumentError(absl::StrCat("work item: vocab slice [", item.vocab_begin(), ", ",
                                                     item.vocab_end(), ") is not rank ", comm.rank(), "'s"));
    const auto [own_begin, own_end] = SplitRange(n, comm.size(), comm.rank());
    ResultRows rows(job.spec, own_begin, own_end, &res);
    absl::Status st;
    if (item.layout() == internal::v1::HIDDEN_STATES) {
      if (!hidden || !hidden->gemm)
        return absl::FailedPreconditionError("work item: hidden states sent to a worker without an lm_head");
      if (hidden->gemm->rows() != slice_len || hidden->gemm->hidden_size() != item.hidden_size())
        return absl::InvalidArgumentError(absl::StrCat("work item: lm_head slice is [", hidden->gemm->rows(), ", ",
                                                       hidden->gemm->hidden_size(), "], item wants [", slice_len, ", ",
                                                       item.hidden_size(), "]"));
      if (static_cast<int64_t>(item.hidden_states().size()) != (own_end - own_begin) * item.hidden_size() * static_cast<int64_t>(esize))
        return absl::InvalidArgumentError("work item: hidden_states size does not match this rank's rows");
      st = ScoreHiddenStates(job, comm, *hidden, own_begin, rows);
    } else {
      if (static_cast<int64_t>(item.logits().size()) != n * slice_len * static_cast<int64_t>(esize))
        return absl::InvalidArgumentError("work item: logits size does not match num_rows");
      st = ScoreLogitsSlices(job, comm, own_begin, rows);
    }
    if (!st.ok()) return st;
  }
  res.set_compute_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return res;
}

}  // namespace logprob
