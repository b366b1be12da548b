// The rows of one lm_head update as they arrive (server/heads/lm_head_updates.h
// is the protocol around them): which ranges came, the copy into the
// staged file, retries compared with what came, and the one scan for NaN
// and infinite weights.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "logprob/internal/v1/worker.pb.h"
#include "server/heads/staged_file_hasher.h"
#include "server/heads/staged_version.h"
#include "server/inputs/input_source.h"

namespace logprob {

/// The row intake of one update of a [V, H] weight of one dtype: a ledger
/// of the row ranges given (every row exactly once; a retry of exactly a
/// range received whole is compared with the staged bytes instead), the
/// copy of each put's rows into the staged file (on up to 4 threads, or by
/// a worker for rows the front-end cannot read), each put's scan for NaN
/// and infinity while its rows are in cache, and the hasher told of every
/// whole put. Its errors start with `label`. Thread-safe: puts of disjoint
/// ranges run concurrently; Seal and Close end the intake.
class RowIntake {
 public:
  struct Options {
    std::string label;  // what errors name: "lm_head update <tag>"
    DType dtype = v1::DTYPE_UNSPECIFIED;
    int64_t vocab_size = 0, hidden_size = 0;
    /// A worker copies rows of a source the front-end cannot read into the
    /// staged file (LmHeadWorkers::stage); empty: such sources are refused.
    std::function<absl::Status(const internal::v1::LmHeadStage&)> stage;
    /// Bytes of a whole put received (metrics); may be empty.
    std::function<void(int64_t bytes)> on_bytes;
  };
  /// Writes that fill a put's rows themselves (LmHeadPutIo::follow).
  using Follow = std::function<absl::Status(char* dst, const std::function<void(int64_t written)>& progressed)>;

  explicit RowIntake(Options options);
  RowIntake(const RowIntake&) = delete;
  RowIntake& operator=(const RowIntake&) = delete;

  /// Rows [row_begin, row_begin + rows) from `source` (rows * H * sizeof(dtype)
  /// bytes; `dtype` and `columns` as the sender announced them) into
  /// `staged`'s file, then told to `hasher`: the rows received by then.
  /// NOT_FOUND when closed ("has ended: why"); FAILED_PRECONDITION when
  /// sealed, or with the kind's unavailable reason for a source the
  /// front-end cannot read and no stage; INVALID_ARGUMENT for a range
  /// outside [0, V), another dtype or H, a source of the wrong size, rows
  /// already given (or being given), a retry with other bytes or that
  /// cannot be compared (CUDA IPC); the source's error (DATA_LOSS) or the
  /// stage's (named, reason kept) when the rows cannot be had: the range
  /// is then free again; ABORTED when closed while the rows arrived.
  absl::StatusOr<int64_t> Put(const StagedVersion& staged, StagedFileHasher& hasher, int64_t row_begin, int64_t rows,
                              DType dtype, int64_t columns, const InputSource& source) ABSL_LOCKS_EXCLUDED(mu_);
  /// Put for rows `follow` writes to their place itself, reporting progress
  /// as they arrive (the written prefix is scanned then); `cancel`, when
  /// not empty, ends its call on Close(why, true). Put's errors, and
  /// follow's.
  absl::StatusOr<int64_t> PutFollowing(const StagedVersion& staged, StagedFileHasher& hasher, int64_t row_begin,
                                       int64_t rows, DType dtype, int64_t columns, const Follow& follow,
                                       const std::function<void()>& cancel) ABSL_LOCKS_EXCLUDED(mu_);

  /// No put may start from now on (a commit): FAILED_PRECONDITION, leaving
  /// it open, while puts are in progress or rows are missing (naming the
  /// first missing range).
  absl::Status Seal() ABSL_LOCKS_EXCLUDED(mu_);
  /// The update ended (`why`: "aborted: ..." or "it was committed"): puts
  /// in progress answer ABORTED with it, later ones NOT_FOUND. With
  /// `cancel_waiting` (a time-out), then ends the calls of puts waiting for
  /// bytes (PutFollowing's `cancel`), so they too answer ABORTED.
  void Close(const std::string& why, bool cancel_waiting = false) ABSL_LOCKS_EXCLUDED(mu_);

  /// OK, or INVALID_ARGUMENT naming the weight's first NaN or infinite
  /// element received (row, column, value) in `rows` (the staged rows).
  absl::Status CheckFinite(const char* rows) const ABSL_LOCKS_EXCLUDED(mu_);
  /// When a put last made progress (opened: construction).
  std::chrono::steady_clock::time_point last_progress() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t rows_received() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Scan;
  /// Writes a put's rows to `dst` (their place in the staged file, or a
  /// retry's buffer), scanning them into `scan`.
  using Fill = std::function<absl::Status(char* dst, Scan* scan)>;
  /// Put / PutFollowing: the checks (`source`'s when not null), the range
  /// claimed, filled, then counted or freed.
  absl::StatusOr<int64_t> Receive(const StagedVersion& staged, StagedFileHasher& hasher, int64_t row_begin,
                                  int64_t rows, DType dtype, int64_t columns, const InputSource* source,
                                  const Fill& fill) ABSL_LOCKS_EXCLUDED(mu_);
  /// Rows of a readable `source` copied to `dst` in 16 MiB blocks on up to
  /// 4 threads, each 1 MiB scanned right after its copy.
  absl::Status Copy(const InputSource& source, char* dst, Scan* scan) ABSL_LOCKS_EXCLUDED(mu_);
  /// Rows of `source` (not readable here) copied by a worker into `staged`.
  absl::Status Stage(const StagedVersion& staged, int64_t row_begin, int64_t rows, const InputSource& source) const;
  void Progressed() ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  const int64_t row_bytes_;
  mutable absl::Mutex mu_;
  std::map<int64_t, int64_t> ranges_ ABSL_GUARDED_BY(mu_);  // rows received or being received: begin -> end
  std::set<int64_t> received_ ABSL_GUARDED_BY(mu_);         // begins of the ranges received whole
  int64_t rows_received_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;  // puts in progress
  bool sealed_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<std::string> closed_ ABSL_GUARDED_BY(mu_);  // why it ended
  // The weight's first NaN or infinite element among the rows received
  // (row-major), if any.
  std::optional<int64_t> first_non_finite_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point last_progress_ ABSL_GUARDED_BY(mu_);
  // Puts waiting for bytes from their transport: how to end each call.
  std::map<int, std::function<void()>> waiting_ ABSL_GUARDED_BY(mu_);
  int next_wait_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace logprob
