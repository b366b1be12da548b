#include "server/heads/row_intake.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "common/finite_check.h"
#include "common/status_macros.h"

namespace logprob {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kCopyBytes = size_t{16} << 20;  // rows a source reads at a time
constexpr int64_t kCopyThreads = 4;              // threads that read one put's rows, at most
constexpr size_t kScanBytes = size_t{1} << 20;   // rows copied, then scanned for NaN / Inf, at a time

}  // namespace

/// The one scan for NaN and infinity of a put's rows: spans of elements
/// (from the put's first row, row-major) scanned as they land, on any
/// threads; the first such element found. Thread-safe.
class RowIntake::Scan {
 public:
  explicit Scan(DType dtype) : dtype_(dtype), elt_(static_cast<int64_t>(DTypeSize(dtype))) {}
  /// Elements [begin, end) of the put's rows at `rows`; nothing to do when
  /// one before `begin` was found already.
  void Span(const char* rows, int64_t begin, int64_t end) {
    if (end <= begin || first_.load() < begin) return;
    if (const std::optional<int64_t> bad = FirstNonFinite(dtype_, rows + begin * elt_, end - begin)) {
      const int64_t e = begin + *bad;
      for (int64_t seen = first_.load(); e < seen && !first_.compare_exchange_weak(seen, e);) {
      }
    }
  }
  std::optional<int64_t> first() const {
    const int64_t f = first_.load();
    return f == std::numeric_limits<int64_t>::max() ? std::nullopt : std::optional<int64_t>(f);
  }

 private:
  const DType dtype_;
  const int64_t elt_;
  std::atomic<int64_t> first_{std::numeric_limits<int64_t>::max()};
};

RowIntake::RowIntake(Options options)
    : options_(std::move(options)),
      row_bytes_(options_.hidden_size * static_cast<int64_t>(DTypeSize(options_.dtype))),
      last_progress_(Clock::now()) {}

absl::StatusOr<int64_t> RowIntake::Put(const StagedVersion& staged, StagedFileHasher& hasher, int64_t row_begin,
                                       int64_t rows, DType dtype, int64_t columns, const InputSource& source) {
  return Receive(staged, hasher, row_begin, rows, dtype, columns, &source, [&](char* dst, Scan* scan) {
    // Bytes the front-end cannot read (a client's GPU memory): a worker on
    // this host writes them into the staged file, then they are scanned
    // there; the others are copied (and scanned) here.
    if (source.rules().readable_here) return Copy(source, dst, scan);
    LOGPROB_RETURN_IF_ERROR(Stage(staged, row_begin, rows, source));
    scan->Span(dst, 0, rows * options_.hidden_size);
    return absl::OkStatus();
  });
}

absl::StatusOr<int64_t> RowIntake::PutFollowing(const StagedVersion& staged, StagedFileHasher& hasher,
                                                int64_t row_begin, int64_t rows, DType dtype, int64_t columns,
                                                const Follow& follow, const std::function<void()>& cancel) {
  return Receive(staged, hasher, row_begin, rows, dtype, columns, nullptr, [&](char* dst, Scan* scan) {
    // The prefix of dst written so far is scanned as it grows (the newest
    // piece is in cache), the rest at the end.
    const int64_t elt = static_cast<int64_t>(DTypeSize(dtype));
    const int64_t elements = rows * options_.hidden_size;
    int64_t scanned = 0;  // elements
    const auto progressed = [&](int64_t written) {
      const int64_t end = std::clamp<int64_t>(written / elt, 0, elements);
      scan->Span(dst, scanned, end);
      scanned = std::max(scanned, end);
      Progressed();
    };
    // While it waits for bytes, a time-out of the update ends its call.
    int key = 0;
    if (cancel) {
      absl::MutexLock lock(&mu_);
      key = ++next_wait_;
      waiting_[key] = cancel;
    }
    const absl::Status st = follow(dst, progressed);
    if (st.ok()) scan->Span(dst, scanned, elements);
    absl::MutexLock lock(&mu_);
    waiting_.erase(key);
    return st;
  });
}

absl::StatusOr<int64_t> RowIntake::Receive(const StagedVersion& staged, StagedFileHasher& hasher, int64_t row_begin,
                                           int64_t rows, DType dtype, int64_t columns, const InputSource* source,
                                           const Fill& fill) {
  const int64_t V = options_.vocab_size;
  bool verify = false;  // a retry of a range received whole
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::NotFoundError(absl::StrCat(options_.label, " has ended: ", *closed_));
    if (sealed_) return absl::FailedPreconditionError(absl::StrCat(options_.label, " is being committed"));
    // Compared without forming row_begin + rows first: both come from the sender (any int64).
    if (rows <= 0 || row_begin < 0 || row_begin >= V || rows > V - row_begin)
      return absl::InvalidArgumentError(absl::StrCat("rows [", row_begin, ", ", row_begin, " + ", rows,
                                                     ") are not a non-empty range of the head's [0, ", V, ")"));
    const int64_t row_end = row_begin + rows;
    if (dtype != options_.dtype || columns != options_.hidden_size)
      return absl::InvalidArgumentError(absl::StrCat("rows: [", rows, ", ", columns, "] ", DTypeName(dtype),
                                                     " given; the update's rows are [n, ", options_.hidden_size, "] ",
                                                     DTypeName(options_.dtype)));
    if (source != nullptr && source->byte_size() != rows * row_bytes_)
      return absl::InvalidArgumentError(absl::StrCat("rows [", row_begin, ", ", row_end, "): ", source->byte_size(),
                                                     " bytes given, ", rows * row_bytes_, " expected (", rows,
                                                     " rows of ", row_bytes_, " bytes)"));
    if (source != nullptr && !source->rules().readable_here && !options_.stage)
      return WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "rows [", row_begin, ", ", row_end, "): this server has no worker that can read ", source->rules().name,
              " rows into the update; send the rows as bytes (in pieces or through shared memory)")),
          source->rules().unavailable);
    // A retry of a put that was received whole: compared, not counted.
    if (auto same = ranges_.find(row_begin);
        same != ranges_.end() && same->second == row_end && received_.count(row_begin) > 0) {
      if (source != nullptr && !source->rules().readable_here)
        return absl::InvalidArgumentError(
            absl::StrCat("rows [", row_begin, ", ", row_end, ") were already received; their ", source->rules().name,
                         " source cannot be compared with them here: they need not be sent again"));
      verify = true;
    }
    // The first range at or after row_begin, and the one before it.
    auto next = ranges_.lower_bound(row_begin);
    if (!verify && ((next != ranges_.end() && next->first < row_end) ||
                    (next != ranges_.begin() && std::prev(next)->second > row_begin))) {
      auto clash = (next != ranges_.begin() && std::prev(next)->second > row_begin) ? std::prev(next) : next;
      return absl::InvalidArgumentError(absl::StrCat("rows [", row_begin, ", ", row_end, ") overlap rows [",
                                                     clash->first, ", ", clash->second,
                                                     ") already given to this update; every row comes exactly once"));
    }
    ranges_[row_begin] = row_end;
    ++busy_;
    last_progress_ = Clock::now();
  }
  const int64_t total = rows * row_bytes_, first_byte = row_begin * row_bytes_;
  char* const dst = staged.rows() + static_cast<uint64_t>(first_byte);
  Scan scan(options_.dtype);
  if (verify) {
    // The retry's bytes, read as any put's, then compared with the staged ones.
    std::string again(static_cast<size_t>(total), '\0');
    const absl::Status read = fill(again.data(), &scan);
    absl::MutexLock lock(&mu_);
    --busy_;
    last_progress_ = Clock::now();
    if (closed_) return absl::AbortedError(absl::StrCat(options_.label, " ended while its rows arrived: ", *closed_));
    if (!read.ok()) return read;
    if (std::memcmp(again.data(), dst, again.size()) != 0)
      return absl::InvalidArgumentError(absl::StrCat("rows [", row_begin, ", ", row_begin + rows,
                                                     ") were already received with other bytes; every row comes "
                                                     "exactly once"));
    return rows_received_;  // the first put's answer
  }
  // Only whole, written puts are hashed and scanned: a failed put's rows
  // may come again.
  const absl::Status failed = fill(dst, &scan);
  if (failed.ok()) hasher.Written(first_byte, first_byte + total);
  if (failed.ok() && options_.on_bytes) options_.on_bytes(total);
  absl::MutexLock lock(&mu_);
  --busy_;
  last_progress_ = Clock::now();
  // Ended meanwhile (a time-out, an abort, the server stopping): why.
  if (closed_) return absl::AbortedError(absl::StrCat(options_.label, " ended while its rows arrived: ", *closed_));
  if (!failed.ok()) {
    ranges_.erase(row_begin);  // the rows may be sent again
    return failed;
  }
  rows_received_ += rows;
  bytes_ += total;
  received_.insert(row_begin);
  if (const std::optional<int64_t> bad = scan.first()) {
    const int64_t at = row_begin * columns + *bad;
    first_non_finite_ = std::min(first_non_finite_.value_or(at), at);
  }
  return rows_received_;
}

absl::Status RowIntake::Copy(const InputSource& source, char* rows_dst, Scan* scan) {
  const int64_t total = source.byte_size();
  const std::optional<std::string_view> memory = source.memory();
  // Blocks of kCopyBytes, taken in turn by up to kCopyThreads threads: a
  // checkpoint is read with pread, which the kernel copies page by page
  // (on tmpfs about a third of memcpy's speed, one core), a client's
  // region through its mapping, so a large put reads on several cores. Each kScanBytes is
  // scanned for NaN and infinity while it is in the core's cache, so the
  // commit need not read the whole weight again.
  const int64_t blocks = (total + static_cast<int64_t>(kCopyBytes) - 1) / static_cast<int64_t>(kCopyBytes);
  const int64_t elt = static_cast<int64_t>(DTypeSize(options_.dtype));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  auto copy = [&] {
    for (int64_t b = next++; b < blocks && !failed.load(); b = next++) {
      const int64_t off = b * static_cast<int64_t>(kCopyBytes);
      const int64_t end = std::min<int64_t>(off + static_cast<int64_t>(kCopyBytes), total);
      for (int64_t at = off; at < end && !failed.load(); at += static_cast<int64_t>(kScanBytes)) {
        const size_t n = static_cast<size_t>(std::min<int64_t>(kScanBytes, end - at));
        char* dst = rows_dst + static_cast<uint64_t>(at);
        if (memory) {
          std::memcpy(dst, memory->data() + at, n);
        } else if (!source.Read(at, n, dst)) {
          failed = true;
          break;
        }
        scan->Span(rows_dst, at / elt, (at + static_cast<int64_t>(n)) / elt);
      }
      Progressed();  // a long put is progress
    }
  };
  const int64_t threads =
      std::min<int64_t>({blocks, kCopyThreads, std::max<int64_t>(1, std::thread::hardware_concurrency())});
  std::vector<std::thread> helpers;
  try {
    for (int64_t i = 1; i < threads; ++i) helpers.emplace_back(copy);
  } catch (const std::system_error&) {
    // No thread to be had (a process or memory limit): fewer threads read.
  }
  copy();
  for (std::thread& t : helpers) t.join();
  if (failed) return source.status().ok() ? absl::DataLossError("the rows' source could not be read") : source.status();
  return absl::OkStatus();
}

absl::Status RowIntake::Stage(const StagedVersion& staged, int64_t row_begin, int64_t rows,
                              const InputSource& source) const {
  const int64_t total = rows * row_bytes_;
  const std::string what = absl::StrCat("rows [", row_begin, ", ", row_begin + rows, ")");
  internal::v1::WorkItem item;
  if (!source.Refer(0, total, &item) || !item.has_cuda_ipc())
    return absl::InternalError(
        absl::StrCat(what, ": the front-end can neither read their ", source.rules().name, " source nor refer to it"));
  internal::v1::LmHeadStage stage;
  *stage.mutable_source() = std::move(*item.mutable_cuda_ipc());
  stage.set_file(staged.partial());
  stage.set_file_offset(static_cast<int64_t>(staged.data_offset()) + row_begin * row_bytes_);
  const absl::Status st = options_.stage(stage);
  if (st.ok()) return st;
  const absl::Status named(st.code(), absl::StrCat(what, ": copying them from the client's ", source.rules().name,
                                                   " memory on a worker failed: ", st.message(),
                                                   "; send them again, or as bytes (in pieces or through shared "
                                                   "memory)"));
  // The worker's reason, unchanged: CUDA_IPC_UNAVAILABLE from a worker that
  // cannot open the reference (the client sends bytes).
  return WithReason(named, ReasonOf(st));
}

void RowIntake::Progressed() {
  absl::MutexLock lock(&mu_);
  last_progress_ = Clock::now();
}

absl::Status RowIntake::Seal() {
  absl::MutexLock lock(&mu_);
  if (busy_ > 0)
    return absl::FailedPreconditionError(
        absl::StrCat(options_.label, ": ", busy_, " PutLmHeadRows call(s) still in progress"));
  const int64_t V = options_.vocab_size;
  if (rows_received_ != V) {
    int64_t gap = 0;
    for (const auto& [b, e] : ranges_) {
      if (b > gap) break;
      gap = e;
    }
    auto after = ranges_.upper_bound(gap);
    const int64_t gap_end = after == ranges_.end() ? V : after->first;
    return absl::FailedPreconditionError(absl::StrCat(options_.label, ": ", V - rows_received_,
                                                      " rows missing, first [", gap, ", ", gap_end,
                                                      "); send them before committing"));
  }
  sealed_ = true;
  return absl::OkStatus();
}

void RowIntake::Close(const std::string& why, bool cancel_waiting) {
  absl::MutexLock lock(&mu_);
  closed_ = why;
  // Closed first: a put whose call this ends finds why when it returns.
  if (cancel_waiting)
    for (const auto& [key, cancel] : waiting_) cancel();
}

absl::Status RowIntake::CheckFinite(const char* rows) const {
  std::optional<int64_t> bad;
  {
    absl::MutexLock lock(&mu_);
    bad = first_non_finite_;
  }
  if (!bad) return absl::OkStatus();
  const DType dtype = options_.dtype;
  float value = 0;
  ToFloat(dtype, rows + *bad * static_cast<int64_t>(DTypeSize(dtype)), 1, &value);
  return absl::InvalidArgumentError(absl::StrCat(options_.label, ": row ", *bad / options_.hidden_size, ", column ",
                                                 *bad % options_.hidden_size, " of the weight is ",
                                                 std::isnan(value) ? "NaN" : (value > 0 ? "+Inf" : "-Inf"),
                                                 "; weights must be finite; nothing changed"));
}

std::chrono::steady_clock::time_point RowIntake::last_progress() const {
  absl::MutexLock lock(&mu_);
  return last_progress_;
}

int64_t RowIntake::rows_received() const {
  absl::MutexLock lock(&mu_);
  return rows_received_;
}

int64_t RowIntake::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace logprob
