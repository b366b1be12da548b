// The CUDA kernels' element type (row_kernels.h's ElemType, which device
// code sees without protobuf) of a wire / checkpoint DType. Host code only.
#pragma once

#include "common/dtype.h"
#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {

/// kBF16 for BF16, kF16 for F16, kF32 for F32 (the dtypes a tensor of
/// floats arrives in; callers have checked it is one of them).
inline ElemType ElemTypeOf(DType d) {
  return d == v1::BF16 ? ElemType::kBF16 : d == v1::F16 ? ElemType::kF16 : ElemType::kF32;
}

}  // namespace logprob::cuda
