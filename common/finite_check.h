// Finding non-finite weights (NaN, +-Inf) in F32 / BF16 / F16 data.
#pragma once

#include <cstdint>
#include <optional>

#include "common/dtype.h"

namespace logprob {

/// The index of the first element of `n` elements of `dtype` at `data`
/// whose exponent bits are all ones (NaN or an infinity), or nullopt when
/// every one is finite. One pass that ORs a flag over blocks of 4096
/// elements (the compiler vectorises it; ~memory bandwidth) and looks for
/// the element only in the block that has one. F32, BF16 and F16; other
/// dtypes are all finite. Pure; thread-safe.
std::optional<int64_t> FirstNonFinite(DType dtype, const void* data, int64_t n);

}  // namespace logprob
