// Memory gauges of the front-end, computed when /metrics is scraped.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace logprob {

/// Gauges read at scrape time (docs/serving.md, "Memory sizing"):
///   process_resident_memory_bytes  the front-end's VmRSS (/proc/self/statm);
///   logprob_kept_freed_bytes       freed heap memory malloc keeps resident
///                                  (KeptFreedBytes: RssAnon minus bytes in
///                                  use; TrimKeptFreedMemory returns it above
///                                  --keep-freed-memory-bytes);
///   logprob_pooled_bytes{pool}     idle bytes each registered pool keeps
///                                  for reuse (chunk_buffers,
///                                  payload_regions);
///   logprob_memory_bound_bytes     FrontendMemoryBound::total() of the
///                                  server's limits (0 until set).
/// Thread-safe: pools may be added and removed while a scrape runs; a
/// pool's callback is never called after its registration is gone.
class MemoryMetrics : public prometheus::Collectable {
 public:
  /// Removes its pool from the gauges when destroyed.
  class PoolRegistration {
   public:
    PoolRegistration(MemoryMetrics* owner, int id) : owner_(owner), id_(id) {}
    ~PoolRegistration() { owner_->RemovePool(id_); }
    PoolRegistration(const PoolRegistration&) = delete;
    PoolRegistration& operator=(const PoolRegistration&) = delete;

   private:
    MemoryMetrics* const owner_;
    const int id_;
  };

  /// Reports `idle_bytes()` as logprob_pooled_bytes{pool=`name`} while the
  /// returned registration lives (the pool must outlive it).
  std::unique_ptr<PoolRegistration> AddPool(std::string name, std::function<int64_t()> idle_bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  void SetBound(int64_t bytes) { bound_bytes_ = bytes; }

  std::vector<prometheus::MetricFamily> Collect() const override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pool {
    std::string name;
    std::function<int64_t()> idle_bytes;
  };
  void RemovePool(int id) ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  std::map<int, Pool> pools_ ABSL_GUARDED_BY(mu_);
  int next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> bound_bytes_{0};
};

}  // namespace logprob
