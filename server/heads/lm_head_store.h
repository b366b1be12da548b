// The files of updated lm_head versions (the store): staged files and
// their read-write mappings, the spare files released versions leave for
// the next updates of their head, the committed files' mappings and the
// hashes still computing over them, bias files, and the store's bytes.
// The update protocol (server/heads/lm_head_updates.h) decides what goes in.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "common/lm_head_source.h"
#include "logprob/v1/logprob.pb.h"
#include "server/heads/lm_heads.h"
#include "server/heads/staged_file_hasher.h"

namespace logprob {

/// A store file mapped read-write (munmap when the last holder goes).
using FileMap = std::shared_ptr<char>;

/// The suffix of a version's own bias file (`<stem>` + it), beside its
/// weight `<stem>.safetensors` in the store.
inline constexpr char kStoreBiasSuffix[] = ".bias.safetensors";

/// The safetensors header of one tensor "lm_head.weight" [V, H] of `dtype`,
/// with its 8-byte length prefix, padded with spaces to a whole page: the
/// weight starts at a page boundary, so workers map their rows aligned
/// (HostBytes::MapMemoryFile). The weight's V * H * sizeof(dtype) bytes
/// follow it in a store file.
std::string StoreFileHeader(DType dtype, int64_t V, int64_t H);

/// The files of one store folder (`dir`, made and locked by its owner:
/// server/heads/store_folder.h). Names are unique within the folder (a counter);
/// nothing else writes there. Thread-safe.
class LmHeadStore {
 public:
  /// `dir` exists (or is made by the first StagedFile). A spare unused for
  /// `spare_idle` is removed (Tidy), except each head's newest.
  explicit LmHeadStore(std::string dir, std::chrono::steady_clock::duration spare_idle = std::chrono::seconds(60));
  /// Removes the spares (committed and staged files are their owners').
  ~LmHeadStore();
  LmHeadStore(const LmHeadStore&) = delete;
  LmHeadStore& operator=(const LmHeadStore&) = delete;

  const std::string& dir() const { return dir_; }

  /// A path stem for a new version of `head`: `<dir>/<head>-<n>`, n never
  /// used before in this store. The version's files are `<stem>.safetensors`
  /// (`.partial` while staged) and `<stem>.bias.safetensors`.
  std::string NewStem(const std::string& head) ABSL_LOCKS_EXCLUDED(mu_);

  /// True when `file` is in this store (a committed or staged version's).
  bool IsOwn(const std::string& file) const;
  /// True when a released file of `head` waits for its next update.
  bool HasSpare(const std::string& head) const ABSL_LOCKS_EXCLUDED(mu_);

  /// True when `file` is a version's own bias file in this store
  /// (`<stem>.bias.safetensors`: removed with that version).
  bool IsOwnBias(const std::string& file) const;

  /// Writes `bias` (a checked [V] tensor) to `path` (a store path from
  /// NewStem) as a safetensors file and locates it. INTERNAL
  /// (RESOURCE_EXHAUSTED when the disk is full) on failure.
  static absl::StatusOr<LmHeadBiasSource> WriteBias(const std::string& path, const v1::Tensor& bias);
  /// Copies the bias `from` (another version's own file) to `path`.
  /// INTERNAL naming both on failure.
  static absl::StatusOr<LmHeadBiasSource> CopyBias(const LmHeadBiasSource& from, const std::string& path);

  /// Opens `path` read-write as a staged file of `size` bytes for `head`,
  /// and sets `map` to its read-write mapping (page tables populated): the
  /// head's spare renamed if it has that size (with its mapping, kept since
  /// its commit), else a new file with its blocks allocated (writes through
  /// the mapping never run out of space). The fd, or -1 (errno set; ENOSPC
  /// when the store is full) on failure.
  int StagedFile(const std::string& head, const std::string& path, uint64_t size, FileMap* map)
      ABSL_LOCKS_EXCLUDED(mu_);

  /// A committed version's `file`: its mapping is kept (the update that
  /// reuses the file as a spare finds its page tables populated), and its
  /// `hasher` lives on until the digest is computed (Tidy) or the version
  /// is released (Recycle).
  void Keep(const std::string& file, FileMap map, std::unique_ptr<StagedFileHasher> hasher) ABSL_LOCKS_EXCLUDED(mu_);

  /// A released version's files: its own bias file is removed; its weight
  /// file is kept as one of its head's spares (at most two; Tidy removes a
  /// spare idle for `spare_idle`, but never a head's newest) when every
  /// worker `dropped` the version, else removed. A hash of the file still
  /// running is abandoned.
  void Recycle(const LmHeadVersion& v, bool dropped) ABSL_LOCKS_EXCLUDED(mu_);

  /// Removes spares idle for `spare_idle` (each head's newest stays) and
  /// forgets finished hashers. Called periodically (LmHeadUpdates' thread).
  void Tidy() ABSL_LOCKS_EXCLUDED(mu_);

  /// Bytes the store's files take (allocated blocks, st_blocks * 512, of
  /// every file in dir()): in memory for a tmpfs store. The store's metric
  /// (logprob_lm_head_store_bytes) and ServerInfo.lm_head_store_bytes.
  int64_t Bytes() const { return BytesOf(dir_); }
  /// Bytes() of the folder `dir` (0 when it cannot be read).
  static int64_t BytesOf(const std::string& dir);

 private:
  /// StagedFile's mapping of `fd` (`path`, `size` bytes): `fd`, or -1
  /// (errno set; `fd` closed, `path` removed).
  static int MapStaged(int fd, const std::string& path, uint64_t size, FileMap* map);

  const std::string dir_;
  const std::chrono::steady_clock::duration spare_idle_;
  mutable absl::Mutex mu_;
  int64_t next_file_ ABSL_GUARDED_BY(mu_) = 0;
  struct Spare {
    std::string path;
    FileMap map;                                  // its read-write mapping, page tables populated (may be null)
    std::chrono::steady_clock::time_point since;  // released then; removed when idle for long
  };
  // head -> released store files to reuse (kSparesPerHead at most)
  std::map<std::string, std::vector<Spare>> spares_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, FileMap> maps_ ABSL_GUARDED_BY(mu_);  // committed store file -> its mapping
  // Committed versions' hashers whose digest is still computing, by file.
  std::map<std::string, std::unique_ptr<StagedFileHasher>> hashing_ ABSL_GUARDED_BY(mu_);
};

}  // namespace logprob
