#include "worker/kernels/sampling_filter.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace logprob::kernels {

float SamplingKeepMin(const float* x, int64_t V, int top_k, float top_p, std::vector<float>* scratch) {
  float keep_min = -std::numeric_limits<float>::infinity();
  const bool use_k = top_k > 0 && top_k < V;
  const bool use_p = top_p > 0.f && top_p < 1.f;
  if (!use_k && !use_p) return keep_min;
  std::vector<float>& v = *scratch;
  v.assign(x, x + V);
  if (use_k) {
    // kth largest; ties at it are kept.
    std::nth_element(v.begin(), v.begin() + (top_k - 1), v.end(), std::greater<float>());
    keep_min = v[top_k - 1];
    v.resize(std::remove_if(v.begin(), v.end(), [&](float a) { return !(a >= keep_min); }) - v.begin());
  }
  if (use_p) {
    std::sort(v.begin(), v.end(), std::greater<float>());
    const double mx = v.front();
    double z = 0.0;
    for (float a : v) z += std::exp(static_cast<double>(a) - mx);
    // Walk groups of equal values from the largest; a group stays while the
    // mass strictly above it is < top_p.
    double above = 0.0;
    size_t i = 0;
    while (i < v.size()) {
      if (i > 0 && !(above / z < top_p)) break;
      size_t j = i;
      while (j < v.size() && v[j] == v[i]) ++j;
      keep_min = v[i];
      above += static_cast<double>(j - i) * std::exp(static_cast<double>(v[i]) - mx);
      i = j;
    }
  }
  return keep_min;
}

}  // namespace logprob::kernels
