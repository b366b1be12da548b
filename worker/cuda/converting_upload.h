// Uploading an lm_head's weights to the device in another element type
// (issue 34): the conversion runs on the GPU, chunk by chunk through a
// small device staging buffer, so an update at a precision that is not the
// checkpoint's dtype (BF16 weights at tf32 / fp32, F32 / F16 weights at
// bf16) allocates and first-touches no host memory: a host-side widening
// wrote a fresh [rows, H] f32 vector (2x the slice) at every version.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {

/// dst[n] (device, `dst_type` kBF16 or kF32) = src[n] (host memory,
/// pageable or page-locked, `src_type`) converted as LaunchConvert does:
/// to bf16 with round to nearest even (f16 through f32 exactly), to f32
/// exactly; the bytes are those common/dtype.h's ToFloat and FloatToBf16
/// give on the host. The source goes through `staging` (device, at least
/// one element of `src_type`; `staging_bytes` of it are used, rounded down
/// to whole elements) in chunks, copied and converted in stream order on a
/// stream of this call's own; returns once dst holds every element. The
/// same types are a plain copy (no staging used). On every exit, errors
/// included, nothing this call queued still runs: dst and staging may be
/// reused or freed once it returns.
/// INVALID_ARGUMENT for n < 0, a kF16 destination or staging smaller than
/// one element; INTERNAL (UNAVAILABLE for a sticky device fault) for CUDA
/// errors. Thread-safe (the caller owns dst and staging).
absl::Status UploadConverted(const void* src, ElemType src_type, int64_t n, void* dst, ElemType dst_type, void* staging,
                             size_t staging_bytes);

/// Staging bytes UploadConverted is given for a weight upload of
/// `src_bytes`: at most 64 MiB.
inline size_t UploadStagingBytes(size_t src_bytes) {
  constexpr size_t kMax = size_t{64} << 20;
  return src_bytes < kMax ? src_bytes : kMax;
}

}  // namespace logprob::cuda
