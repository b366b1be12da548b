// cuBLASLt statuses as absl::Status, with the CUDA context asked about an
// execution failure (issue 50): a kernel of the GEMM that hit a device
// fault makes cuBLASLt answer CUBLAS_STATUS_EXECUTION_FAILED, and that
// fault is sticky: mapped to INTERNAL, the worker would keep failing every
// request instead of leaving the pool for a fresh process. Host code,
// templated on the runtime's last-error call (cuda_error.h) so it is
// tested on the CPU with a fake (tests/cuda_error_test.cc).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/cuda/cuda_error.h"
#include "worker/cuda/device_buffers.h"

namespace logprob::cuda {

/// The Status of a cuBLASLt call `what` that returned `s`: OK for
/// CUBLAS_STATUS_SUCCESS. For CUBLAS_STATUS_EXECUTION_FAILED the CUDA
/// error behind it is looked for: the thread's last error (a launch that
/// failed; read, so it is not left behind) and `context()`, a runtime call
/// that reports the context's state (cudaStreamQuery of the GEMM's stream:
/// a sticky error is reported by every call; cudaErrorNotReady is no
/// error). When that error is sticky the result is CudaStatusOf's
/// UNAVAILABLE (StickyErrorSeen set: the worker answers UNAVAILABLE and the
/// pool re-forms); otherwise, and for every other status, INTERNAL naming
/// the cuBLASLt status (and the CUDA error, when one was found).
/// Thread-safe (per-thread state).
template <typename Errors = CudaRuntimeErrors, typename Context>
absl::Status LtStatusOf(cublasStatus_t s, const char* what, Context&& context) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string cause;
  if (s == CUBLAS_STATUS_EXECUTION_FAILED) {
    const cudaError_t launch = Errors::GetLastError();
    cudaError_t e = ClearedError<Errors>(context());
    if (e == cudaErrorNotReady) e = cudaSuccess;
    if (e == cudaSuccess) e = launch;
    if (e != cudaSuccess) {
      absl::Status st = CudaStatusOf<Errors>(e, what);
      if (absl::IsUnavailable(st)) return st;
      cause = absl::StrCat("; CUDA: ", cudaGetErrorName(e));
    }
  }
  return absl::InternalError(
      absl::StrCat("cuBLASLt ", what, ": ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s), ")", cause));
}

}  // namespace logprob::cuda
