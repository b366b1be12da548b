// One version of a head being staged in the lm_head store, from its name
// to its commit or discard: the store's side of an update's files.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "server/heads/lm_head_store.h"
#include "server/heads/staged_file_hasher.h"

namespace logprob {

/// The files of one staged version in `store`: `<stem>.safetensors.partial`
/// while staged, `<stem>.safetensors` once committed, and its own bias file
/// `<stem>.bias.safetensors` (written by its owner, removed with it).
/// Made with names only (nothing on disk); Create makes the staged file
/// (a spare of the head's, or a new one with its blocks allocated, so no
/// write through the mapping can fault for space), writes its header and
/// maps it read-write (rows are copied in with memcpy, which on a tmpfs
/// store runs several times faster than pwrite); Commit renames it to its
/// final name; Keep hands its mapping to the store (the update that reuses
/// the file finds its page tables populated); Discard removes every file. The
/// destructor closes the file and discards it unless it was committed.
/// Not thread-safe, except rows() and the accessors, which may be read
/// from any thread once Create returned (puts write the rows concurrently).
class StagedVersion {
 public:
  /// A new version of `head` in `store` (which outlives this): its stem is
  /// LmHeadStore::NewStem(head). Takes `store`'s lock briefly.
  StagedVersion(LmHeadStore* store, const std::string& head);
  ~StagedVersion();
  StagedVersion(const StagedVersion&) = delete;
  StagedVersion& operator=(const StagedVersion&) = delete;

  /// The committed name, `<stem>.safetensors`.
  const std::string& file() const { return file_; }
  /// The name while staged, `<stem>.safetensors.partial`.
  const std::string& partial() const { return partial_; }
  /// This version's own bias file, `<stem>.bias.safetensors`.
  const std::string& bias_file() const { return bias_file_; }

  /// Makes the staged file: one tensor [V, H] of `dtype` (StoreFileHeader,
  /// then the rows), mapped read-write with its page tables populated.
  /// RESOURCE_EXHAUSTED when the store is full, INTERNAL otherwise, both
  /// "cannot create <partial>: <why>". Once.
  absl::Status Create(DType dtype, int64_t V, int64_t H);
  /// The staged file, open read-write (-1 before Create).
  int fd() const { return fd_; }
  /// Where the rows start in the file (the header's size).
  uint64_t data_offset() const { return data_offset_; }
  /// The rows in the file's mapping (null before Create).
  char* rows() const { return map_ ? map_.get() + data_offset_ : nullptr; }

  /// Renames the staged file to file(). INTERNAL "cannot rename <partial>:
  /// <why>" on failure (the file keeps its staged name; Discard removes it).
  absl::Status Commit();
  /// A committed version's mapping and `hasher` go to the store
  /// (LmHeadStore::Keep): the file is the version's from now on.
  void Keep(std::unique_ptr<StagedFileHasher> hasher);
  /// Removes the version's files (staged, committed and bias names): an
  /// aborted update. The mapping stays valid for puts still writing.
  /// Idempotent.
  void Discard();

 private:
  StagedVersion(LmHeadStore* store, std::string head, const std::string& stem);

  LmHeadStore* const store_;
  const std::string head_, file_, partial_, bias_file_;
  int fd_ = -1;
  uint64_t data_offset_ = 0;
  FileMap map_;
  bool committed_ = false, discarded_ = false;
};

}  // namespace logprob
