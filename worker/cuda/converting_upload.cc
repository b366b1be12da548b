#include "worker/cuda/converting_upload.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/device_buffers.h"

namespace logprob::cuda {

absl::Status UploadConverted(const void* src, ElemType src_type, int64_t n, void* dst, ElemType dst_type, void* staging,
                             size_t staging_bytes) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("UploadConverted: n = ", n, " < 0"));
  if (dst_type == ElemType::kF16) return absl::InvalidArgumentError("UploadConverted: no f16 destination");
  if (n == 0) return absl::OkStatus();
  const size_t src_size = ElemSize(src_type);
  if (src_type == dst_type) return UploadAndWait(dst, src, static_cast<size_t>(n) * src_size);
  const int64_t chunk = static_cast<int64_t>(staging_bytes / src_size);
  if (chunk <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("UploadConverted: ", staging_bytes, " staging bytes hold no element of ", src_size, " bytes"));
  const size_t dst_size = ElemSize(dst_type);
  Stream s;
  LOGPROB_RETURN_IF_ERROR(s.Create());
  // On an error exit the chunks already queued still read `staging` and
  // write `dst`: waited for, so the caller may hand both back to their
  // recyclers (issue 50); their own errors are cleared (a sticky one
  // recorded), the first error is the one returned.
  absl::Cleanup settle = [&s] { CudaStatus(cudaStreamSynchronize(s.get()), "weight upload").IgnoreError(); };
  // One stream orders each chunk's copy after the previous chunk's
  // conversion, so the one staging buffer is never overwritten early.
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t m = n - i < chunk ? n - i : chunk;
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging, static_cast<const char*>(src) + i * src_size,
                                                 static_cast<size_t>(m) * src_size, cudaMemcpyHostToDevice, s.get()),
                                 "weight upload");
    LOGPROB_CUDA_RETURN_IF_ERROR(
        LaunchConvert(staging, src_type, m, static_cast<char*>(dst) + i * dst_size, dst_type, s.get()),
        "weight conversion");
  }
  std::move(settle).Cancel();
  return CudaStatus(cudaStreamSynchronize(s.get()), "weight upload");
}

}  // namespace logprob::cuda
