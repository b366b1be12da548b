// What becomes of the lm_head versions LmHeads lets go: the queue they
// wait in, the workers dropping them, and their store files recycled.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "logprob/internal/v1/worker.pb.h"
#include "server/heads/lm_head_store.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// Versions LmHeads released (LmHeads::Options::on_release pushes them),
/// waiting for LmHeadUpdates' thread to have the workers drop them and to
/// remove their store files. Thread-safe; Push takes only its own lock.
class LmHeadReleases {
 public:
  void Push(const LmHeadVersion& version) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<LmHeadVersion> Take() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::vector<LmHeadVersion> queue_ ABSL_GUARDED_BY(mu_);
};

/// Takes the versions waiting in an LmHeadReleases queue, has the workers
/// drop each (best effort) and recycles the store files of updated ones
/// (LmHeadStore::Recycle: a spare when every worker dropped it, else
/// removed). Thread-safe: one Release runs at a time, so a caller's
/// Release returns only after the versions another caller took are
/// recycled (their files can take the caller's rows). No errors: a worker
/// that does not drop a version only keeps its file from being reused.
class VersionReleases {
 public:
  /// `store` outlives this; `drop` may be empty (every version counts as
  /// dropped).
  VersionReleases(std::shared_ptr<LmHeadReleases> queue, LmHeadStore* store,
                  std::function<bool(const internal::v1::LmHeadRef&)> drop);

  /// The versions released since the last call: dropped and recycled.
  void Release() ABSL_LOCKS_EXCLUDED(mu_);
  /// Release, then the store's idle spares and finished hashes go
  /// (LmHeadStore::Tidy): the periodic work of LmHeadUpdates' thread.
  void Tidy() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::shared_ptr<LmHeadReleases> queue_;
  LmHeadStore* const store_;
  const std::function<bool(const internal::v1::LmHeadRef&)> drop_;
  absl::Mutex mu_;  // held across Release
};

}  // namespace logprob
