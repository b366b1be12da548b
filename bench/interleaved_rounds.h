// Interleaved rounds of benchmark cases with medians: every round runs each
// case once, in order, so slow drifts of a noisy machine (clocks, other
// processes) hit all cases alike. A case that fails keeps its error and is
// left out of the later rounds; the others go on.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace logprob {

/// Median of `v` (the mean of the two middle values for an even count; 0
/// when empty).
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

/// One timed case. `run` does the whole operation and returns once it is
/// complete (synchronised); `timer`, when set, replaces the wall clock: it
/// runs `run` and returns its milliseconds (e.g. from CUDA events).
struct BenchCase {
  std::string name;
  std::function<absl::Status()> run;
  std::function<absl::Status(double* ms)> timer;
  absl::Status status;     // the first error, if any
  std::vector<double> ms;  // one per successful round
  bool ok() const { return status.ok() && !ms.empty(); }
  /// (max - min) / median of the rounds, in percent (0 without any): how
  /// noisy the case was.
  double spread_percent() const {
    if (ms.empty()) return 0;
    const auto [lo, hi] = std::minmax_element(ms.begin(), ms.end());
    const double m = median();
    return m > 0 ? 100.0 * (*hi - *lo) / m : 0;
  }
  /// Median of the rounds' milliseconds (0 without any).
  double median() const { return Median(ms); }
};

/// One untimed warm-up round, then `rounds` timed rounds over `cases`.
inline void RunInterleaved(std::vector<BenchCase>& cases, int rounds) {
  const auto once = [](BenchCase& c, double* ms) -> absl::Status {
    if (c.timer) return c.timer(ms);
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = c.run();
    *ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return st;
  };
  for (int r = -1; r < rounds; ++r) {
    for (BenchCase& c : cases) {
      if (!c.status.ok()) continue;
      double ms = 0;
      c.status = once(c, &ms);
      if (c.status.ok() && r >= 0) c.ms.push_back(ms);
    }
  }
}

}  // namespace logprob
