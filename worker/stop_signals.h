// The runs a worker was told to stop (Worker.Stop).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace logprob {

/// Run ids the front-end sent Worker.Stop for, polled by the items of
/// those runs (their should_stop). A Stop may arrive before its item
/// starts (the item then stops at its first check) or after it ended, so
/// ids are not removed by the items: the set keeps the last `capacity`
/// ids, far more than the runs one front-end has in flight (one per
/// request thread). Run ids are unique per front-end (WorkerPool starts
/// them at a random value). Thread-safe.
class StopSignals {
 public:
  explicit StopSignals(size_t capacity = 4096) : capacity_(capacity) {}

  /// Remembers that run `run_id` must stop.
  void Stop(uint64_t run_id) ABSL_LOCKS_EXCLUDED(mu_);
  /// True when Stop(run_id) was called (and not yet forgotten).
  bool Stopped(uint64_t run_id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::unordered_set<uint64_t> ids_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

}  // namespace logprob
