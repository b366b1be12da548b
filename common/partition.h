// Balanced splitting of a range into contiguous parts, shared by the
// front-end's planner and the workers so both agree on who owns what.
#pragma once

#include <cstdint>
#include <utility>

namespace logprob {

/// Part `i` of `parts` of [0, n): sizes differ by at most one, larger parts
/// first (n = 50257, parts = 2 -> [0, 25129), [25129, 50257)).
inline std::pair<int64_t, int64_t> SplitRange(int64_t n, int64_t parts, int64_t i) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = i * base + (i < extra ? i : extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

}  // namespace logprob
