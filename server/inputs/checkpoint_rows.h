// The rows of a checkpoint's lm_head weight as an input source: what an
// lm_head update's file put (LmHeadRows.file) reads its rows from.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/lm_head_source.h"
#include "server/inputs/input_source.h"

namespace logprob {

/// A checkpoint's lm_head weight (every row, row-major), read with
/// positioned reads through the descriptor it was resolved with (never
/// reopened by name). Kind kFile. Thread-safe.
class CheckpointRows final : public InputSource {
 public:
  /// Resolves checkpoint `path` (relative to `dir`; PATH and TENSOR of
  /// ResolveLmHead with `tensor`) with every file it names (checkpoint,
  /// index, shards, config.json) opened once beneath `dir` without
  /// following symlinks at any component, non-blocking, checked to be a
  /// regular file (OpenBeneath), and at most `max_metadata_bytes` of each
  /// read into memory. PERMISSION_DENIED when `dir` is empty (file sources
  /// are off: --lm-head-update-dir), for an absolute path, ".." or a
  /// symlink; FAILED_PRECONDITION when `dir` cannot be opened or for a
  /// FIFO, device or other non-regular file; NOT_FOUND for no such file
  /// beneath `dir`; ResolveLmHead's errors otherwise. Errors name the path
  /// given, never bytes read.
  static absl::StatusOr<std::unique_ptr<CheckpointRows>> OpenBeneath(const std::string& dir, const std::string& path,
                                                                     const std::string& tensor,
                                                                     uint64_t max_metadata_bytes);

  /// `opened`: the checkpoint resolved, its weight file held open.
  explicit CheckpointRows(OpenedLmHead opened);

  /// The resolved checkpoint: shape, dtype, transform, bias (names as
  /// resolved: relative to the directory it was opened beneath).
  const LmHeadSource& source() const { return source_; }

  /// The weight's bytes [offset, offset + n); DATA_LOSS (status()) naming
  /// the tensor and file when they cannot be read.
  bool Read(int64_t offset, size_t n, char* dst) const override;
  absl::Status status() const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const LmHeadSource source_;
  const std::shared_ptr<UniqueFd> weight_;
  const int fd_;
  mutable absl::Mutex mu_;
  mutable absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace logprob
