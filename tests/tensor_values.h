// A public v1::Tensor holding given values inline, for the unit tests that
// build requests by hand (score_job_backward_test, rollout_mismatch_test).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "logprob/v1/logprob.pb.h"

namespace logprob::testing {

/// Tensor `name` of `dtype` and `shape` whose data is `values`' bytes (T
/// must be the dtype's element type, or uint16_t bits of BF16 / F16).
template <typename T>
v1::Tensor TensorOf(const std::string& name, v1::DType dtype, const std::vector<int64_t>& shape,
                    const std::vector<T>& values) {
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
  return t;
}

}  // namespace logprob::testing
