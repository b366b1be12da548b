// The SHA-256 of a file being written in any order, computed in order on
// its own thread as the written bytes form a longer prefix.
#pragma once

#include <cstdint>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/sha256.h"

namespace logprob {

/// Hashes bytes [data_offset, data_offset + total) of the file `fd` with
/// SHA-256, on a thread of its own (reading through a duplicate of `fd`,
/// so the caller may close it): each Written(begin, end) says that those
/// bytes (relative to data_offset) are in the file; the thread reads and
/// hashes the written prefix as it grows, in 4 MiB positioned reads, so
/// writers never wait for the hash (an lm_head update's rows:
/// LmHeadUpdates). `background`: nobody waits for the digest soon (it is
/// not checked before a commit), so the thread hashes nothing before
/// Start() (the rows' transfer keeps the CPU and memory bandwidth) and
/// then runs at the lowest CPU priority (nice 19), yielding to scoring.
/// Thread-safe.
class StagedFileHasher {
 public:
  StagedFileHasher(int fd, uint64_t data_offset, int64_t total, bool background = false);
  /// Stops the thread (a Finish not yet called is abandoned).
  ~StagedFileHasher();
  StagedFileHasher(const StagedFileHasher&) = delete;
  StagedFileHasher& operator=(const StagedFileHasher&) = delete;

  /// Bytes [begin, end) are in the file. Ranges may come in any order and
  /// must not overlap (the caller's rows come exactly once).
  void Written(int64_t begin, int64_t end) ABSL_LOCKS_EXCLUDED(mu_);
  /// A background hasher may begin (see the class comment); no-op otherwise.
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  /// Waits until every byte [0, total) was written and hashed, then the
  /// lower-case hex digest (a background hasher must have been started). INTERNAL when the file could not be read back.
  absl::StatusOr<std::string> Finish() ABSL_LOCKS_EXCLUDED(mu_);
  /// The digest as a future: ready once every byte was hashed; "" when
  /// the file could not be read back or this was destroyed first.
  std::shared_future<std::string> digest() const { return digest_; }

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  /// Loop's work until every byte is hashed (hex_ set), a read fails or
  /// stop_; `buf` is its read buffer.
  void Hash(std::vector<char>& buf) ABSL_LOCKS_EXCLUDED(mu_);

  const int fd_;  // a duplicate, closed by the destructor
  const uint64_t data_offset_;
  const int64_t total_;
  const bool background_;
  Sha256Stream sha_;                   // the thread's only
  std::promise<std::string> promise_;  // set once, by the thread as it ends
  std::shared_future<std::string> digest_;

  absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when pending_, hashed_, failed_ or stop_ change
  std::map<int64_t, int64_t> pending_ ABSL_GUARDED_BY(mu_);  // written, not yet hashed: begin -> end
  int64_t hashed_ ABSL_GUARDED_BY(mu_) = 0;                  // [0, hashed_) is in sha_
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_);     // false for a background hasher until Start()
  std::string hex_ ABSL_GUARDED_BY(mu_);  // the digest once hashed_ == total_
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace logprob
