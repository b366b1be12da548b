#include "client/latency_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace logprob::client {

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double pos = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return sorted[lo] + frac * (sorted[hi] - sorted[lo]);
}

LatencySummary Summarize(std::vector<double> seconds) {
  LatencySummary s;
  if (seconds.empty()) return s;
  std::sort(seconds.begin(), seconds.end());
  s.count = static_cast<int64_t>(seconds.size());
  s.mean = std::accumulate(seconds.begin(), seconds.end(), 0.0) / static_cast<double>(s.count);
  s.min = seconds.front();
  s.max = seconds.back();
  s.p50 = Percentile(seconds, 50);
  s.p90 = Percentile(seconds, 90);
  s.p99 = Percentile(seconds, 99);
  return s;
}

}  // namespace logprob::client
