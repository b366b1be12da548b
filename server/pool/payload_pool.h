// Reusable shared memory regions for work-item payloads (PlanWork).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"

namespace logprob {

/// Regions for the payloads of plans whose workers share this host. A
/// region's pages are reserved and mapped once and the workers keep their
/// mapping of it (WorkerService), so steady traffic pays neither page
/// faults nor mmap per request. Thread-safe.
class PayloadPool {
 public:
  /// Keeps at most `max_idle` idle regions and `max_idle_bytes` of them
  /// (the largest ones that fit; FrontendMemoryBound counts the cap).
  explicit PayloadPool(int max_idle = 4, int64_t max_idle_bytes = INT64_MAX);

  /// The region size Acquire(bytes) creates: the next power of two >=
  /// max(bytes, 1 MiB).
  static size_t RegionSize(size_t bytes);

  /// Bytes of the idle regions (shared memory kept mapped for reuse).
  int64_t idle_bytes() const;

  /// A region of at least `bytes` bytes, used by nobody else until the
  /// last copy of the returned pointer goes (then it is idle again): the
  /// smallest idle one that fits, else a new one of the next power of two
  /// >= max(bytes, 1 MiB). Errors of SharedRegion::Create.
  absl::StatusOr<std::shared_ptr<SharedRegion>> Acquire(size_t bytes);

 private:
  struct State {
    absl::Mutex mu;
    int max_idle = 0;            // constant
    int64_t max_idle_bytes = 0;  // constant
    std::vector<std::unique_ptr<SharedRegion>> idle ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<State> state_;  // shared with the leases, which may outlive the pool
};

}  // namespace logprob
