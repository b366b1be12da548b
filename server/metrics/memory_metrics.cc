#include "server/metrics/memory_metrics.h"

#include <unistd.h>

#include <fstream>

#include "common/malloc_tuning.h"

namespace logprob {
namespace {

prometheus::MetricFamily Gauge(std::string name, std::string help) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = prometheus::MetricType::Gauge;
  return f;
}

void Add(prometheus::MetricFamily& family, double value, std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  family.metric.push_back(std::move(m));
}

/// VmRSS of this process, bytes (0 if /proc is unreadable).
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * sysconf(_SC_PAGESIZE);
}

}  // namespace

std::unique_ptr<MemoryMetrics::PoolRegistration> MemoryMetrics::AddPool(std::string name,
                                                                        std::function<int64_t()> idle_bytes) {
  absl::MutexLock lock(&mu_);
  const int id = next_id_++;
  pools_[id] = Pool{std::move(name), std::move(idle_bytes)};
  return std::make_unique<PoolRegistration>(this, id);
}

void MemoryMetrics::RemovePool(int id) {
  absl::MutexLock lock(&mu_);
  pools_.erase(id);
}

std::vector<prometheus::MetricFamily> MemoryMetrics::Collect() const {
  std::vector<prometheus::MetricFamily> out;
  out.push_back(Gauge("process_resident_memory_bytes", "Resident memory of the front-end (VmRSS), bytes"));
  Add(out.back(), static_cast<double>(ResidentBytes()));
  out.push_back(
      Gauge("logprob_kept_freed_bytes",
            "Freed heap memory malloc keeps resident for reuse (RssAnon minus malloc's bytes in use), bytes"));
  Add(out.back(), static_cast<double>(KeptFreedBytes()));
  out.push_back(Gauge("logprob_pooled_bytes", "Idle bytes kept for reuse, by pool"));
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, pool] : pools_)
      Add(out.back(), static_cast<double>(pool.idle_bytes()), {{"pool", pool.name}});
  }
  out.push_back(Gauge("logprob_memory_bound_bytes",
                      "Upper bound of the front-end's resident memory from its limits (docs/serving.md), bytes"));
  Add(out.back(), static_cast<double>(bound_bytes_.load()));
  return out;
}

}  // namespace logprob
