#include "worker/scoring/one_pass_layout.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/partition.h"

namespace logprob {

int64_t AlignRows(int64_t rows) { return (rows + kSlotAlignRows - 1) / kSlotAlignRows * kSlotAlignRows; }

int64_t RankRows::total() const {
  int64_t n = 0;
  for (int64_t c : count) n += c;
  return n;
}

int64_t RankRows::most() const {
  int64_t m = 0;
  for (int64_t c : count) m = std::max(m, c);
  return m;
}

RankRows SplitRows(int64_t n, int W) {
  RankRows r;
  for (int q = 0; q < W; ++q) {
    const auto [b, e] = SplitRange(n, W, q);
    r.first.push_back(b);
    r.count.push_back(e - b);
  }
  return r;
}

std::vector<int64_t> Displacements(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> d(sizes.size());
  int64_t at = 0;
  for (size_t q = 0; q < sizes.size(); ++q) {
    d[q] = at;
    at += sizes[q];
  }
  return d;
}

int64_t PassLayout::total() const {
  int64_t n = 0;
  for (int64_t c : count) n += c;
  return n;
}

void PassLayout::RecordExchange(int me, size_t words, std::vector<int64_t>* send_bytes,
                                std::vector<int64_t>* recv_bytes) const {
  const size_t W = count.size();
  const int64_t record_bytes = static_cast<int64_t>(words) * 4;
  send_bytes->assign(W, 0);
  recv_bytes->assign(W, count[me] * record_bytes);
  for (size_t q = 0; q < W; ++q) (*send_bytes)[q] = count[q] * record_bytes;
}

OnePassLayout::OnePassLayout(RankRows rows, int64_t pass_rows)
    : rows_(std::move(rows)), pass_rows_(std::max<int64_t>(pass_rows, 1)) {
  const int64_t most = rows_.most();
  passes_ = (most + pass_rows_ - 1) / pass_rows_;
}

PassLayout OnePassLayout::Pass(int64_t p) const {
  PassLayout l;
  const int W = rows_.size();
  l.pass_row0 = p * pass_rows_;
  l.item_first.resize(W);
  l.count.resize(W);
  l.record_row.resize(W);
  int64_t most = 0, packed = 0;
  for (int q = 0; q < W; ++q) {
    l.item_first[q] = rows_.first[q] + l.pass_row0;
    l.count[q] = std::clamp<int64_t>(rows_.count[q] - l.pass_row0, 0, pass_rows_);
    l.record_row[q] = packed;
    packed += l.count[q];
    most = std::max(most, l.count[q]);
  }
  l.slot_rows = AlignRows(most);
  return l;
}

int64_t OnePassLayout::max_slot_rows() const {
  int64_t m = 0;
  for (int64_t p = 0; p < passes_; ++p) m = std::max(m, Pass(p).slot_rows);
  return m;
}

int64_t OnePassLayout::max_total_rows() const {
  int64_t m = 0;
  for (int64_t p = 0; p < passes_; ++p) m = std::max(m, Pass(p).total());
  return m;
}

absl::Status CheckRankRows(const RankRows& rows, int W, int64_t n) {
  if (static_cast<int>(rows.first.size()) != W || rows.size() != W)
    return absl::InvalidArgumentError(
        absl::StrCat("hidden-states item: ", rows.first.size(), " rank ranges for ", W, " ranks"));
  int64_t next = 0;
  for (int q = 0; q < W; ++q) {
    if (rows.first[q] != next || rows.count[q] < 0)
      return absl::InvalidArgumentError(absl::StrCat("hidden-states item: rank ", q, "'s rows [", rows.first[q], ", +",
                                                     rows.count[q], ") do not follow rank ", q - 1, "'s"));
    next += rows.count[q];
  }
  if (next != n)
    return absl::InvalidArgumentError(absl::StrCat("hidden-states item: ranks hold ", next, " rows, targets ", n));
  return absl::OkStatus();
}

int64_t PassRowsForBudget(size_t pass_bytes, int W, size_t row_bytes) {
  const size_t per_row = std::max<size_t>(static_cast<size_t>(std::max(W, 1)) * std::max<size_t>(row_bytes, 1), 1);
  const int64_t rows = static_cast<int64_t>(pass_bytes / per_row);
  return std::max(kSlotAlignRows, rows - rows % kSlotAlignRows);
}

absl::StatusOr<int64_t> AgreeOnPass(Communicator& comm, PassVote vote, int64_t pass_rows, const absl::Status& failure) {
  const int W = comm.size();
  const int64_t mine[2] = {static_cast<int64_t>(vote), pass_rows};
  std::vector<int64_t> all(2 * static_cast<size_t>(W));
  if (absl::Status st = comm.AllGather(mine, sizeof mine, all.data()); !st.ok()) return st;
  int failed = -1;
  bool cancelled = false;
  int64_t agreed = pass_rows;
  for (int q = 0; q < W; ++q) {
    const int64_t v = all[2 * q];
    if (v == static_cast<int64_t>(PassVote::kFailed) && failed < 0) failed = q;
    if (v == static_cast<int64_t>(PassVote::kCancelled)) cancelled = true;
    agreed = std::min(agreed, all[2 * q + 1]);
  }
  if (failed >= 0) {
    if (vote == PassVote::kFailed) return failure.ok() ? absl::InternalError("one-pass item: local failure") : failure;
    return absl::ResourceExhaustedError(
        absl::StrCat("one-pass hidden-states item: rank ", failed, " could not prepare the pass (device memory?)"));
  }
  if (cancelled) return absl::CancelledError("stopped: the request was cancelled or its deadline passed");
  return std::max<int64_t>(agreed, 1);
}

absl::Status AgreeAfterUploads(Communicator& comm, bool stopping, int64_t pass_rows, const absl::Status& queued,
                               absl::FunctionRef<absl::Status()> wait) {
  absl::Status uploaded = queued;
  if (uploaded.ok() && !stopping) uploaded = wait();
  const PassVote vote = !uploaded.ok() ? PassVote::kFailed : stopping ? PassVote::kCancelled : PassVote::kGo;
  return AgreeOnPass(comm, vote, pass_rows, uploaded).status();
}

}  // namespace logprob
