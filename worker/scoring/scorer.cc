#include "worker/scoring/scorer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/input_kind.h"
#include "common/partition.h"
#include "common/status_macros.h"
#include "worker/kernels/row_stats.h"
#include "worker/kernels/sampling_filter.h"
#include "worker/scoring/hidden_rounds.h"
#include "worker/scoring/host_partials.h"
#include "worker/scoring/one_pass_layout.h"

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
  spec.log_sum_sq_probs = o.log_sum_sq_probs();
  spec.mean_logits = o.mean_logits();
  spec.is_top1 = o.is_top1();
  spec.topk = o.topk();
  spec.gather_k = item.gather_k();
  spec.vocab_size = item.vocab_size();
  return spec;
}

bool HasFilters(const WorkItem& item) { return HasSamplingFilters(item.options()); }

/// Output arrays of the rows a rank returns, in WorkResult layout.
class ResultRows {
 public:
  ResultRows(const StatsSpec& spec, int64_t begin, int64_t end, WorkResult* res) : spec_(spec), res_(res) {
    const int64_t n = end - begin;
    res->set_row_begin(begin);
    res->set_row_end(end);
    res->mutable_token_logprobs()->Resize(static_cast<int>(n), 0.f);
    if (spec.entropy) res->mutable_entropy()->Resize(static_cast<int>(n), 0.f);
    if (spec.log_sum_sq_probs) res->mutable_log_sum_sq_probs()->Resize(static_cast<int>(n), 0.f);
    if (spec.mean_logits) res->mutable_mean_logits()->Resize(static_cast<int>(n), 0.f);
    if (spec.is_top1) res->mutable_is_top1()->Resize(static_cast<int>(n), 0);
    res->mutable_topk_logprobs()->Resize(static_cast<int>(n * spec.topk), 0.f);
    res->mutable_topk_indices()->Resize(static_cast<int>(n * spec.topk), 0);
    res->mutable_gathered_logprobs()->Resize(static_cast<int>(n * spec.gather_k), 0.f);
  }
  /// Output pointers of local row `i` (0-based within this rank's rows).
  kernels::RowOutput At(int64_t i) {
    kernels::RowOutput o;
    o.token_logprob = res_->mutable_token_logprobs()->mutable_data() + i;
    if (spec_.entropy) o.entropy = res_->mutable_entropy()->mutable_data() + i;
    if (spec_.log_sum_sq_probs) o.log_sum_sq_probs = res_->mutable_log_sum_sq_probs()->mutable_data() + i;
    if (spec_.mean_logits) o.mean_logits = res_->mutable_mean_logits()->mutable_data() + i;
    if (spec_.is_top1) o.is_top1 = res_->mutable_is_top1()->mutable_data() + i;
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
  std::string_view payload;  // the item's logits or hidden states
  StatsSpec spec;
  bool filters;
  SamplingFilter filter;
  ScoringBackend& backend;
  const std::function<bool()>& should_stop;
  const LmHeadWeights* lm_head;  // HIDDEN_STATES: the item's lm_head slice
  std::vector<uint32_t> records;
  /// Sampling masks (WorkItem.masked): each row's range of mask_ids, begin
  /// -1 for an unmasked row; both empty when the item has none.
  std::vector<int64_t> mask_begin, mask_end;

  bool masks() const { return !mask_begin.empty(); }
  /// Rows [row0, row0 + count) of the item, contiguous in its arrays.
  BlockRows Range(int64_t row0, int64_t count) const {
    BlockRows r{count, item.targets().data() + row0,
                spec.gather_k ? item.gather_ids().data() + row0 * spec.gather_k : nullptr};
    if (masks()) {
      r.mask_begin = mask_begin.data() + row0;
      r.mask_end = mask_end.data() + row0;
      r.mask_ids = item.mask_ids().data();
    }
    return r;
  }
  /// The records of a host logits block: masked rows on this thread with the
  /// CPU kernels (no backend's device kernels have masks), else the backend's.
  absl::Status Partials(const LogitsBlock& block, const BlockRows& rows, uint32_t* out) {
    if (!masks()) return backend.SlicePartials(block, rows, spec, out);
    HostSlicePartials(block, rows, spec, out);
    return absl::OkStatus();
  }
};

/// The item's sampling masks as per-row ranges (Job::mask_begin / mask_end),
/// or INVALID_ARGUMENT when its arrays do not fit together.
absl::Status ReadMasks(const WorkItem& item, Job* job) {
  if (item.masked_size() == 0 && item.mask_offsets_size() == 0 && item.mask_ids_size() == 0) return absl::OkStatus();
  const int64_t n = item.num_rows(), nnz = item.mask_ids_size();
  if (item.masked_size() != n || item.mask_offsets_size() != n + 1)
    return absl::InvalidArgumentError("work item: masked / mask_offsets do not match num_rows");
  job->mask_begin.resize(static_cast<size_t>(n));
  job->mask_end.resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    const int64_t a = item.mask_offsets(static_cast<int>(r)), b = item.mask_offsets(static_cast<int>(r + 1));
    if (a < 0 || b < a || b > nnz) return absl::InvalidArgumentError("work item: mask_offsets out of order");
    for (int64_t j = a; j < b; ++j)
      if (item.mask_ids(static_cast<int>(j)) < item.vocab_begin() ||
          item.mask_ids(static_cast<int>(j)) >= item.vocab_end() ||
          (j > a && item.mask_ids(static_cast<int>(j)) <= item.mask_ids(static_cast<int>(j - 1))))
        return absl::InvalidArgumentError("work item: mask_ids not ascending within the vocab slice");
    job->mask_begin[r] = item.masked(static_cast<int>(r)) ? a : -1;
    job->mask_end[r] = b;
  }
  return absl::OkStatus();
}

/// Scores `count` full rows (all V columns, `block.vocab_begin` 0) that are
/// the item's rows [row0, row0 + count); writes them at out.At(row - out_row0).
absl::Status ScoreFullRows(Job& job, const LogitsBlock& block, int64_t row0, int64_t count, int64_t out_row0,
                           ResultRows& out) {
  const size_t words = kernels::PartialWords(job.spec);
  job.records.resize(static_cast<size_t>(count) * words);
  const BlockRows rows = job.Range(row0, count);
  LOGPROB_RETURN_IF_ERROR(job.filters
                              ? job.backend.FilteredRowPartials(block, rows, job.spec, job.filter, job.records.data())
                              : job.Partials(block, rows, job.records.data()));
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t* recs[1] = {job.records.data() + i * words};
    kernels::CombinePartials(recs, 1, job.spec, rows.targets[i] >= 0, out.At(row0 + i - out_row0));
  }
  return absl::OkStatus();
}

/// Targets, gather ids and sampling masks of a round's rows in round order
/// (rank 0's rows first), for the backend.
struct RoundIds {
  std::vector<int64_t> targets, gather_ids, mask_begin, mask_end;
  const int32_t* mask_ids = nullptr;
  RoundIds(const Job& job, const RoundRows& rows) {
    const int k = job.spec.gather_k;
    for (size_t q = 0; q < rows.first.size(); ++q) {
      const BlockRows r = job.Range(rows.first[q], rows.count[q]);
      targets.insert(targets.end(), r.targets, r.targets + r.count);
      if (k) gather_ids.insert(gather_ids.end(), r.gather_ids, r.gather_ids + r.count * k);
      if (job.masks()) {
        mask_begin.insert(mask_begin.end(), r.mask_begin, r.mask_begin + r.count);
        mask_end.insert(mask_end.end(), r.mask_end, r.mask_end + r.count);
        mask_ids = r.mask_ids;
      }
    }
  }
  BlockRows rows() const {
    BlockRows r{static_cast<int64_t>(targets.size()), targets.data(), gather_ids.empty() ? nullptr : gather_ids.data()};
    if (mask_ids != nullptr) {
      r.mask_begin = mask_begin.data();
      r.mask_end = mask_end.data();
      r.mask_ids = mask_ids;
    }
    return r;
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

/// Combines the records of this rank's `mine` rows, item rows [first,
/// first + mine), from all W vocabulary slices: `recv` is
/// [W][mine][PartialWords] rank-major (what the all-to-all delivers),
/// combined in rank order so results do not depend on who finalises.
void CombineOwnRows(Job& job, int W, int64_t first, int64_t mine, const uint32_t* recv, int64_t out_row0,
                    ResultRows& out) {
  const size_t words = kernels::PartialWords(job.spec);
  std::vector<const uint32_t*> recs(W);
  for (int64_t i = 0; i < mine; ++i) {
    const int64_t row = first + i;
    for (int q = 0; q < W; ++q) recs[q] = recv + RecordIndex(q, i, mine, words);
    kernels::CombinePartials(recs.data(), W, job.spec, job.item.targets(static_cast<int>(row)) >= 0,
                             out.At(row - out_row0));
  }
}

/// Finalises the rows this rank owns in one round without sampling
/// filters: `send` holds the packed partial of every row of the round on
/// this rank's slice (round order); one all-to-all brings each owner the
/// partials of its rows, combined in rank order, so results do not depend
/// on who finalises. `out_row0` is the global index of the owner's first
/// result row.
absl::Status ExchangePartials(Job& job, Communicator& comm, const RoundRows& rows, const std::vector<uint32_t>& send,
                              int64_t out_row0, ResultRows& out) {
  const int W = comm.size(), me = comm.rank();
  const int64_t mine = rows.count[me];
  const size_t words = kernels::PartialWords(job.spec);
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  std::vector<uint32_t> recv(mine * W * words);
  for (int q = 0; q < W; ++q) {
    send_bytes[q] = rows.count[q] * static_cast<int64_t>(words) * 4;
    recv_bytes[q] = mine * static_cast<int64_t>(words) * 4;
  }
  LOGPROB_RETURN_IF_ERROR(comm.AllToAllV(send.data(), send_bytes, recv.data(), recv_bytes));
  CombineOwnRows(job, W, rows.first[me], mine, recv.data(), out_row0, out);
  return absl::OkStatus();
}

/// Finalises the rows this rank owns in one round with sampling filters:
/// the all-to-all brings the owner full rows instead (NeMo-RL
/// `all_to_all_vp2sq`), because the filter threshold needs the whole row.
absl::Status ExchangeFullRows(Job& job, Communicator& comm, const RoundRows& rows, const RoundSlice& slice,
                              int64_t out_row0, ResultRows& out) {
  const int W = comm.size(), me = comm.rank();
  const int64_t V = job.item.vocab_size(), mine = rows.count[me];
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
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
  LOGPROB_RETURN_IF_ERROR(comm.AllToAllV(slice.data, send_bytes, recv.data(), recv_bytes));
  std::vector<char> full(static_cast<size_t>(std::max<int64_t>(mine * V, 1)) * esize);
  for (int64_t i = 0; i < mine; ++i) {
    size_t at = static_cast<size_t>(i * V) * esize;
    for (int q = 0; q < W; ++q) {
      const auto [vb, ve] = SplitRange(V, W, q);
      const size_t len = static_cast<size_t>(ve - vb) * esize;
      std::copy_n(recv.data() + recv_off[q] + i * len, len, full.data() + at);
      at += len;
    }
  }
  return ScoreFullRows(job, LogitsBlock{slice.dtype, full.data(), 0, V}, rows.first[me], mine, out_row0, out);
}

/// Collective layouts: the ranks agree whether to go on (hidden_rounds.h).
absl::Status AgreeToGoOn(Job& job, Communicator& comm) { return AgreeToGoOn(comm, job.should_stop); }

/// VOCAB_PARALLEL: rounds of kVocabParallelChunkRows rows of the item.
absl::Status ScoreLogitsSlices(Job& job, Communicator& comm, int64_t own_begin, ResultRows& out) {
  const WorkItem& item = job.item;
  const int W = comm.size();
  const RoundSlice all{item.dtype(), job.payload.data(), item.vocab_begin(), item.vocab_end() - item.vocab_begin()};
  for (int64_t c0 = 0; c0 < item.num_rows(); c0 += kVocabParallelChunkRows) {
    LOGPROB_RETURN_IF_ERROR(AgreeToGoOn(job, comm));
    const int64_t c1 = std::min(item.num_rows(), c0 + kVocabParallelChunkRows);
    RoundRows rows(W);
    for (int q = 0; q < W; ++q) {
      const auto [ob, oe] = SplitRange(item.num_rows(), W, q);
      rows.first[q] = std::max(c0, ob);
      rows.count[q] = std::max<int64_t>(0, std::min(c1, oe) - rows.first[q]);
    }
    RoundSlice slice = all;
    slice.data += c0 * slice.row_bytes();
    if (job.filters) {
      LOGPROB_RETURN_IF_ERROR(ExchangeFullRows(job, comm, rows, slice, own_begin, out));
    } else {
      const RoundIds ids(job, rows);
      std::vector<uint32_t> send(static_cast<size_t>(rows.total()) * kernels::PartialWords(job.spec));
      LOGPROB_RETURN_IF_ERROR(
          job.Partials(LogitsBlock{slice.dtype, slice.data, slice.begin, slice.len}, ids.rows(), send.data()));
      LOGPROB_RETURN_IF_ERROR(ExchangePartials(job, comm, rows, send, own_begin, out));
    }
  }
  return absl::OkStatus();
}

/// HIDDEN_STATES: per round every rank contributes up to chunk_tokens of
/// its hidden rows (one all-gather), multiplies all of them by its lm_head
/// slice and finishes the round like the logits path: the backend's fused
/// GEMM + partials, or (sampling filters) host logits exchanged as full
/// rows. Memory per round: ~chunk_tokens * W rows of hidden states and of
/// this rank's logits slice.
absl::Status ScoreHiddenStates(Job& job, Communicator& comm, int64_t chunk_tokens, int64_t own_begin, ResultRows& out) {
  const WorkItem& item = job.item;
  const int W = comm.size();
  const int64_t n = item.num_rows();
  const size_t hrow = static_cast<size_t>(item.hidden_size()) * DTypeSize(item.dtype());
  const int64_t per_round = std::max<int64_t>(1, chunk_tokens), N = job.lm_head->rows();
  std::vector<char> send, gathered;
  std::vector<float> logits;
  std::vector<uint32_t> records;
  for (int64_t l0 = 0; l0 < LargestShare(n, W); l0 += per_round) {
    LOGPROB_RETURN_IF_ERROR(AgreeToGoOn(job, comm));
    LOGPROB_ASSIGN_OR_RETURN(const RoundRows rows,
                             GatherHiddenRound(comm, job.payload, hrow, n, l0, per_round, &send, &gathered));
    const int64_t packed = rows.total();
    if (job.filters) {
      logits.resize(static_cast<size_t>(packed * N));
      LOGPROB_RETURN_IF_ERROR(
          job.backend.HiddenLogits(*job.lm_head, item.dtype(), gathered.data(), packed, logits.data()));
      const RoundSlice slice{v1::F32, reinterpret_cast<const char*>(logits.data()), item.vocab_begin(), N};
      LOGPROB_RETURN_IF_ERROR(ExchangeFullRows(job, comm, rows, slice, own_begin, out));
    } else if (job.masks()) {
      // Masked rows: the round's logits through host memory, the CPU kernels' masks.
      const RoundIds ids(job, rows);
      logits.resize(static_cast<size_t>(packed * N));
      LOGPROB_RETURN_IF_ERROR(
          job.backend.HiddenLogits(*job.lm_head, item.dtype(), gathered.data(), packed, logits.data()));
      records.resize(static_cast<size_t>(packed) * kernels::PartialWords(job.spec));
      HostSlicePartials(LogitsBlock{v1::F32, logits.data(), item.vocab_begin(), N}, ids.rows(), job.spec,
                        records.data());
      LOGPROB_RETURN_IF_ERROR(ExchangePartials(job, comm, rows, records, own_begin, out));
    } else {
      const RoundIds ids(job, rows);
      records.resize(static_cast<size_t>(packed) * kernels::PartialWords(job.spec));
      LOGPROB_RETURN_IF_ERROR(job.backend.HiddenPartials(*job.lm_head, item.dtype(), gathered.data(),
                                                         item.vocab_begin(), ids.rows(), job.spec, records.data()));
      LOGPROB_RETURN_IF_ERROR(ExchangePartials(job, comm, rows, records, own_begin, out));
    }
  }
  return absl::OkStatus();
}

/// HIDDEN_STATES in one pass (a backend with OnePassHidden(comm), no
/// sampling filters): the backend gathers, multiplies and exchanges the
/// whole item on its device (in passes of bounded memory, polling
/// should_stop between them); this rank combines its own rows' records.
absl::Status ScoreHiddenOnePass(Job& job, Communicator& comm, bool on_device, int64_t own_begin, ResultRows& out) {
  LOGPROB_RETURN_IF_ERROR(AgreeToGoOn(job, comm));
  const WorkItem& item = job.item;
  const int W = comm.size(), me = comm.rank();
  HiddenItemRows h;
  h.dtype = item.dtype();
  h.own = job.payload.data();
  h.own_on_device = on_device;
  h.vocab_begin = item.vocab_begin();
  RankRows ranks = SplitRows(item.num_rows(), W);
  h.first = std::move(ranks.first);
  h.count = std::move(ranks.count);
  h.rows = job.Range(0, item.num_rows());
  h.should_stop = job.should_stop;
  const int64_t mine = h.count[me];
  std::vector<uint32_t> recv(static_cast<size_t>(W * mine) * kernels::PartialWords(job.spec));
  LOGPROB_RETURN_IF_ERROR(job.backend.HiddenItemPartials(*job.lm_head, h, comm, job.spec, recv.data()));
  CombineOwnRows(job, W, h.first[me], mine, recv.data(), own_begin, out);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<WorkResult> ScoreWorkItem(const WorkItem& item, Communicator& comm, ScoringBackend& backend,
                                         int64_t hidden_chunk_tokens, const std::function<bool()>& should_stop,
                                         const LmHeadWeights* lm_head) {
  return ScoreWorkItem(item, std::string_view(item.data()), comm, backend, hidden_chunk_tokens, should_stop, lm_head);
}

absl::StatusOr<WorkResult> ScoreWorkItem(const WorkItem& item, ItemPayload item_payload, Communicator& comm,
                                         ScoringBackend& backend, int64_t hidden_chunk_tokens,
                                         const std::function<bool()>& should_stop, const LmHeadWeights* lm_head) {
  const std::string_view payload = item_payload.bytes;
  const auto t0 = std::chrono::steady_clock::now();
  const auto& o = item.options();
  Job job{item,
          payload,
          SpecOf(item),
          HasFilters(item),
          SamplingFilter{o.sampling_top_k(), o.has_sampling_top_p() ? o.sampling_top_p() : 1.0f},
          backend,
          should_stop,
          lm_head};
  const DType dtype = item.dtype();
  if (item_payload.on_device && item.layout() != internal::v1::HIDDEN_STATES)
    return absl::InvalidArgumentError("work item: only hidden states may be passed in device memory");
  if (!IsFloatDType(dtype)) return absl::InvalidArgumentError("work item: dtype must be F32, BF16 or F16");
  const int64_t n = item.num_rows();
  // Every size bounded before anything is allocated by it: K of top-k and
  // of the gathered ids at most the vocabulary (a K beyond it would size the
  // result rows by a number from the wire).
  if (n < 0 || item.vocab_size() <= 0 || o.topk() < 0 || o.topk() > item.vocab_size() || item.gather_k() < 0 ||
      item.gather_k() > item.vocab_size())
    return absl::InvalidArgumentError(absl::StrCat("work item: num_rows ", n, ", vocab_size ", item.vocab_size(),
                                                   ", topk ", o.topk(), ", gather_k ", item.gather_k(),
                                                   ": need rows >= 0, V > 0 and 0 <= K <= V"));
  if (item.targets_size() != n || item.gather_ids_size() != n * item.gather_k())
    return absl::InvalidArgumentError("work item: targets or gather_ids size does not match num_rows");
  LOGPROB_RETURN_IF_ERROR(ReadMasks(item, &job));
  const size_t esize = DTypeSize(dtype);
  const int64_t slice_len = item.vocab_end() - item.vocab_begin();
  WorkResult res;
  if (item.layout() == internal::v1::TOKEN_PARALLEL) {
    if (item.vocab_begin() != 0 || slice_len != item.vocab_size())
      return absl::InvalidArgumentError("work item: token-parallel rows must be whole");
    if (static_cast<int64_t>(payload.size()) != n * slice_len * static_cast<int64_t>(esize))
      return absl::InvalidArgumentError("work item: logits size does not match num_rows");
    ResultRows rows(job.spec, 0, n, &res);
    for (int64_t r0 = 0; r0 < n; r0 += kVocabParallelChunkRows) {
      if (should_stop && should_stop()) return Stopped();
      const int64_t count = std::min(kVocabParallelChunkRows, n - r0);
      const LogitsBlock block{dtype, payload.data() + r0 * slice_len * esize, 0, slice_len};
      LOGPROB_RETURN_IF_ERROR(ScoreFullRows(job, block, r0, count, 0, rows));
    }
  } else {
    const auto [vb, ve] = SplitRange(item.vocab_size(), comm.size(), comm.rank());
    if (vb != item.vocab_begin() || ve != item.vocab_end())
      return absl::InvalidArgumentError(absl::StrCat("work item: vocab slice [", item.vocab_begin(), ", ",
                                                     item.vocab_end(), ") is not rank ", comm.rank(), "'s"));
    const auto [own_begin, own_end] = SplitRange(n, comm.size(), comm.rank());
    ResultRows rows(job.spec, own_begin, own_end, &res);
    if (item.layout() == internal::v1::HIDDEN_STATES) {
      if (!lm_head) return NoLmHeadError(item.lm_head().name(), item.lm_head().version());
      if (lm_head->rows() != slice_len || lm_head->hidden_size() != item.hidden_size())
        return absl::InvalidArgumentError(absl::StrCat("work item: lm_head slice is [", lm_head->rows(), ", ",
                                                       lm_head->hidden_size(), "], item wants [", slice_len, ", ",
                                                       item.hidden_size(), "]"));
      if (static_cast<int64_t>(payload.size()) !=
          (own_end - own_begin) * item.hidden_size() * static_cast<int64_t>(esize))
        return absl::InvalidArgumentError("work item: hidden_states size does not match this rank's rows");
      // Sampling filters keep the rounds on every backend: a row's top-k /
      // top-p threshold needs all V of its logits in one place, and the
      // one-pass records are per-slice statistics, so the rounds bring the
      // logits to the host (HiddenLogits) and exchange full rows.
      if (backend.OnePassHidden(comm) && !job.filters && !job.masks()) {
        LOGPROB_RETURN_IF_ERROR(ScoreHiddenOnePass(job, comm, item_payload.on_device, own_begin, rows));
      } else if (item_payload.on_device) {
        return absl::FailedPreconditionError(
            job.filters || job.masks()
                ? "hidden states passed as a CUDA IPC handle cannot be scored with sampling filters or masks "
                  "(sampling_top_k / sampling_top_p / sampling_mask_ids): send their bytes instead"
                : "hidden states passed as a CUDA IPC handle need workers that score hidden states in one "
                  "pass (the CUDA backend with NCCL, or one worker)");
      } else {
        LOGPROB_RETURN_IF_ERROR(ScoreHiddenStates(job, comm, hidden_chunk_tokens, own_begin, rows));
      }
    } else {
      if (static_cast<int64_t>(payload.size()) != n * slice_len * static_cast<int64_t>(esize))
        return absl::InvalidArgumentError("work item: logits size does not match num_rows");
      LOGPROB_RETURN_IF_ERROR(ScoreLogitsSlices(job, comm, own_begin, rows));
    }
  }
  res.set_compute_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return res;
}

}  // namespace logprob
