// Keeping the CUDA runtime's per-thread "last error" from going stale.
//
// Every runtime call that fails records its error as the calling thread's
// last error, even when it also returns it and the caller handles it: a
// cudaEventQuery that answers cudaErrorNotReady (not a failure), a
// cudaMalloc that answers cudaErrorMemoryAllocation. A kernel launch
// (`<<<...>>>`) returns nothing, and a launcher that then asks
// cudaGetLastError() would report that stale status as its own failure
// (issue 35 item 1: a NCCL item failing with "device not ready" at the
// next chunk). The helpers below clear what a handled status left behind
// and make a launch's check see only its own error.
//
// The runtime's last-error call is a template parameter (`Errors`, a type
// with `static cudaError_t GetLastError()` that returns the thread's last
// error and resets it to cudaSuccess unless it is sticky), so the logic is
// tested on the CPU with a fake (tests/cuda_error_test.cc). Plain host
// code: included by nvcc and g++ alike.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace logprob::cuda {

/// The CUDA runtime's own last-error call.
struct CudaRuntimeErrors {
  /// cudaGetLastError(): the thread's last error, reset to cudaSuccess
  /// (a sticky error, e.g. an illegal address, stays: every later call of
  /// the context reports it anyway).
  static cudaError_t GetLastError() { return cudaGetLastError(); }
};

/// Returns `own`, the status a runtime call returned for itself, after
/// clearing the thread's last error when `own` is not cudaSuccess: the
/// caller handles `own` (e.g. cudaErrorNotReady of cudaEventQuery /
/// cudaStreamQuery, a failed allocation), so no later
/// cudaGetLastError() reports it again. Use as
/// `ClearedError(cudaEventQuery(event))`. Thread-safe (per-thread state).
template <typename Errors = CudaRuntimeErrors>
cudaError_t ClearedError(cudaError_t own) {
  if (own != cudaSuccess) Errors::GetLastError();
  return own;
}

/// The check of kernel launches (`<<<...>>>`, which return nothing):
/// constructed just before the launches, it clears any error an earlier
/// call left on this thread; Result() is then the error of these launches
/// alone (cudaSuccess when they were accepted), cleared in turn. A sticky
/// error of the context is still reported (the launch fails with it).
/// Asynchronous execution errors surface later, at a synchronisation.
/// Use in a launcher:
///   const LaunchCheck<> check;
///   Kernel<<<grid, block, 0, stream>>>(args);
///   return check.Result();
/// Not shared between threads (the last error is per thread).
template <typename Errors = CudaRuntimeErrors>
class LaunchCheck {
 public:
  LaunchCheck() { Errors::GetLastError(); }
  LaunchCheck(const LaunchCheck&) = delete;
  LaunchCheck& operator=(const LaunchCheck&) = delete;
  /// The launches' own error since construction (cudaSuccess if none).
  cudaError_t Result() const { return Errors::GetLastError(); }
};

/// True for the errors that leave the CUDA context unusable (issue 35
/// item 2): a kernel's illegal address or instruction, a launch failure
/// or timeout, `__trap()` / a device assert, an uncorrectable ECC or
/// NVLink error, ... Every later call of the process's context fails with
/// it; only a new process gets a working device. Any other error `e` is
/// also sticky when the thread's last error does not clear: Errors'
/// GetLastError is read twice (which also clears a non-sticky `e` the
/// caller is handling) and a sticky context reports an error both times.
/// cudaSuccess is never sticky, nor are the errors of a runtime that
/// found no usable device or driver (cudaErrorNoDevice,
/// cudaErrorInsufficientDriver, ...: the runtime repeats them too, but
/// they are a configuration, not a fault of a working device).
/// Thread-safe (per-thread state).
template <typename Errors = CudaRuntimeErrors>
bool IsStickyError(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return false;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorCudartUnloading:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
      Errors::GetLastError();
      return false;
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorExternalDevice:
      Errors::GetLastError();  // keeps the handled error from going stale where it is not sticky
      return true;
    default:
      break;
  }
  Errors::GetLastError();
  return Errors::GetLastError() != cudaSuccess;
}

/// Set (never reset) once this process saw a sticky error (IsStickyError):
/// the worker's CUDA context is broken for good, so the worker answers
/// UNAVAILABLE and its pool re-forms with a fresh process. Thread-safe.
inline std::atomic<bool>& StickyErrorSeen() {
  static std::atomic<bool> seen{false};
  return seen;
}

}  // namespace logprob::cuda
