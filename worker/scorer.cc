#include "worker/scorer.h"

#include <algorithm>
#include <chrono>
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
  DType dtype;
  size_t esize;
  int64_t slice_len;
  bool filters;
  std::vector<uint32_t> record;
  std::vector<float> scratch = std::vector<float>(kernels::kPartialScratchFloats);
  std::vector<float> row_f32;
  std::vector<float> filter_scratch;

  const int64_t* gather_ids(int64_t row) const {
    return spec.gather_k ? item.gather_ids().data() + row * spec.gather_k : nullptr;
  }
  kernels::SliceRow Slice(const void* logits, int64_t row) const {
    kernels::SliceRow r;
    r.logits = logits;
    r.target = item.targets(static_cast<int>(row));
    r.gather_ids = gather_ids(row);
    return r;
  }
};

/// Scores one full row (all V columns of `logits`, in the job's dtype).
void ScoreFullRow(Job& job, const void* logits, int64_t row, const kernels::RowOutput& out) {
  const int64_t V = job.item.vocab_size();
  kernels::SliceRow r = job.Slice(logits, row);
  if (job.filters) {
    job.row_f32.resize(static_cast<size_t>(V));
    ToFloat(job.dtype, logits, static_cast<size_t>(V), job.row_f32.data());
    for (auto& x : job.row_f32) x = x / job.spec.temperature;
    const auto& o = job.item.options();
    r.keep_min = kernels::SamplingKeepMin(job.row_f32.data(), V, o.sampling_top_k(),
                                          o.has_sampling_top_p() ? o.sampling_top_p() : 1.0f,
                                          &job.filter_scratch);
  }
  job.record.resize(kernels::PartialWords(job.spec));
  kernels::ComputePartial(job.dtype, r, 0, V, job.spec, job.record.data(), job.scratch.data());
  const uint32_t* recs[1] = {job.record.data()};
  kernels::CombinePartials(recs, 1, job.spec, r.target >= 0, out);
}

absl::Status VocabParallelStats(Job& job, Communicator& comm, int64_t own_begin, int64_t own_end,
                                ResultRows& rows) {
  const WorkItem& item = job.item;
  const size_t words = kernels::PartialWords(job.spec);
  const int W = comm.size();
  const char* logits = item.logits().data();
  std::vector<uint32_t> send, recv;
  std::vector<const uint32_t*> recs(W);
  for (int64_t c0 = 0; c0 < item.num_rows(); c0 += kVocabParallelChunkRows) {
    const int64_t c1 = std::min(item.num_rows(), c0 + kVocabParallelChunkRows);
    const int64_t n = c1 - c0;
    send.resize(static_cast<size_t>(n) * words);
    recv.resize(send.size() * W);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = c0 + i;
      kernels::ComputePartial(job.dtype, job.Slice(logits + row * job.slice_len * job.esize, row),
                              item.vocab_begin(), job.slice_len, job.spec,
                              send.data() + i * words, job.scratch.data());
    }
    if (auto st = comm.AllGather(send.data(), send.size() * 4, recv.data()); !st.ok()) return st;
    for (int64_t row = std::max(c0, own_begin); row < std::min(c1, own_end); ++row) {
      for (int r = 0; r < W; ++r) recs[r] = recv.data() + (static_cast<size_t>(r) * n + (row - c0)) * words;
      kernels::CombinePartials(recs.data(), W, job.spec, item.targets(static_cast<int>(row)) >= 0,
                               rows.At(row - own_begin));
    }
  }
  return absl::OkStatus();
}

absl::Status VocabParallelFullRows(Job& job, Communicator& comm, int64_t own_begin, int64_t own_end,
                                   ResultRows& rows) {
  const WorkItem& item = job.item;
  const int W = comm.size();
  const int64_t V = item.vocab_size();
  const int64_t row_bytes = job.slice_len * static_cast<int64_t>(job.esize);
  std::vector<char> recv, full(static_cast<size_t>(V) * job.esize);
  for (int64_t c0 = 0; c0 < item.num_rows(); c0 += kVocabParallelChunkRows) {
    const int64_t c1 = std::min(item.num_rows(), c0 + kVocabParallelChunkRows);
    // Rows of this chunk owned by each rank; they are contiguous in `logits`.
    std::vector<int64_t> send_bytes(W), recv_bytes(W), recv_off(W);
    const int64_t mine0 = std::max(c0, own_begin), mine1 = std::min(c1, own_end);
    const int64_t mine = std::max<int64_t>(0, mine1 - mine0);
    int64_t total_recv = 0;
    for (int q = 0; q < W; ++q) {
      const auto [ob, oe] = SplitRange(item.num_rows(), W, q);
      send_bytes[q] = std::max<int64_t>(0, std::min(c1, oe) - std::max(c0, ob)) * row_bytes;
      const auto [vb, ve] = SplitRange(V, W, q);
      recv_bytes[q] = mine * (ve - vb) * static_cast<int64_t>(job.esize);
      recv_off[q] = total_recv;
      total_recv += recv_bytes[q];
    }
    recv.resize(static_cast<size_t>(std::max<int64_t>(total_recv, 1)));
    const char* send = item.logits().data() + c0 * row_bytes;
    if (auto st = comm.AllToAllV(send, send_bytes, recv.data(), recv_bytes); !st.ok()) return st;
    for (int64_t row = mine0; row < mine1; ++row) {
      size_t at = 0;
      for (int q = 0; q < W; ++q) {
        const auto [vb, ve] = SplitRange(V, W, q);
        const size_t len = static_cast<size_t>(ve - vb) * job.esize;
        std::copy_n(recv.data() + recv_off[q] + (row - mine0) * len, len, full.data() + at);
        at += len;
      }
      ScoreFullRow(job, full.data(), row, rows.At(row - own_begin));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<WorkResult> ScoreWorkItem(const WorkItem& item, Communicator& comm) {
  const auto t0 = std::chrono::steady_clock::now();
  Job job{item, SpecOf(item), item.dtype(), DTypeSize(item.dtype()),
          item.vocab_end() - item.vocab_begin(), HasFilters(item)};
  if (!IsFloatDType(job.dtype)) return absl::InvalidArgumentError("work item: logits dtype must be F32, BF16 or F16");
  const bool vocab_parallel = item.layout() == internal::v1::VOCAB_PARALLEL;
  if (vocab_parallel) {
    const auto [vb, ve] = SplitRange(item.vocab_size(), comm.size(), comm.rank());
    if (vb != item.vocab_begin() || ve != item.vocab_end())
      return absl::InvalidArgumentError(absl::StrCat("work item: vocab slice [", item.vocab_begin(), ", ",
                                                     item.vocab_end(), ") is not rank ", comm.rank(), "'s"));
  } else if (item.vocab_begin() != 0 || item.vocab_end() != item.vocab_size()) {
    return absl::InvalidArgumentError("work item: token-parallel rows must be whole");
  }
  const int64_t n = item.num_rows();
  if (static_cast<int64_t>(item.logits().size()) != n * job.slice_len * static_cast<int64_t>(job.esize) ||
      item.targets_size() != n || item.gather_ids_size() != n * item.gather_k())
    return absl::InvalidArgumentError("work item: logits, targets or gather_ids size does not match num_rows");

  WorkResult res;
  if (!vocab_parallel) {
    ResultRows rows(job.spec, 0, n, &res);
    const int64_t row_bytes = job.slice_len * static_cast<int64_t>(job.esize);
    for (int64_t row = 0; row < n; ++row)
      ScoreFullRow(job, item.logits().data() + row * row_bytes, row, rows.At(row));
  } else {
    const auto [own_begin, own_end] = SplitRange(n, comm.size(), comm.rank());
    ResultRows rows(job.spec, own_begin, own_end, &res);
    const absl::Status st = job.filters ? VocabParallelFullRows(job, comm, own_begin, own_end, rows)
                                        : VocabParallelStats(job, comm, own_begin, own_end, rows);
    if (!st.ok()) return st;
  }
  res.set_compute_seconds(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return res;
}

}  // namespace logprob
