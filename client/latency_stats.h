// Latency percentiles of a load run (logprob-client bench).
#pragma once

#include <cstdint>
#include <vector>

namespace logprob::client {

/// The `p`-th percentile (0 <= p <= 100) of `sorted` (ascending, not
/// empty) by linear interpolation between the closest ranks: the value at
/// fractional index p / 100 * (n - 1), as numpy.percentile's default
/// ("linear", Hyndman-Fan type 7). p = 0 is the minimum, p = 100 the
/// maximum; n = 1 gives the single value for every p.
double Percentile(const std::vector<double>& sorted, double p);

/// Summary of a set of latencies, seconds. All zero when `count` is 0.
struct LatencySummary {
  int64_t count = 0;
  double mean = 0;
  double min = 0;
  double p50 = 0;
  double p90 = 0;
  double p99 = 0;
  double max = 0;
};

/// Sorts `seconds` and summarizes it (percentiles as Percentile above).
LatencySummary Summarize(std::vector<double> seconds);

}  // namespace logprob::client
