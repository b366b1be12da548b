// Selecting a CUDA device on any thread, for work done there outside the
// backend's own calls.
//
// Objects that own device memory (an lm_head's weights, cuBLASLt handles)
// may be destroyed on a thread that never selected their device: the
// worker's gRPC threads drop lm_head versions (LmHeadRegistry::Drop). Freed
// there with device 0 current, a multi-GPU host's rank > 0 would create a
// stray context on GPU 0 and free on the wrong device (issue 35 item 4).
// SelectDevice makes the owner's device current first.
//
// The runtime calls are a template parameter (`Api`: static GetDevice,
// SetDevice and GetLastError with the CUDA runtime's meaning), so the logic
// is tested on the CPU with a fake (tests/cuda_select_device_test.cc).
#pragma once

#include <cuda_runtime_api.h>

#include "worker/cuda/cuda_error.h"

namespace logprob::cuda {

/// The CUDA runtime's device selection calls.
struct CudaRuntimeDevice {
  static cudaError_t GetDevice(int* device) { return cudaGetDevice(device); }
  static cudaError_t SetDevice(int device) { return cudaSetDevice(device); }
  static cudaError_t GetLastError() { return cudaGetLastError(); }
};

/// Makes `device` the calling thread's current device unless it already
/// is (then no call that could initialise a context is made). The device
/// stays current afterwards: a worker process works on one device, and
/// restoring the thread's previous (often the implicit 0) would itself
/// create a context on device 0 (cudaSetDevice initialises the device's
/// primary context). Returns whether `device` is current; the errors of
/// these calls are cleared (ClearedError) so no later cudaGetLastError()
/// reports them: callers are destructors, which cannot report them.
/// Thread-safe (per-thread state).
template <typename Api = CudaRuntimeDevice>
bool SelectDevice(int device) {
  int current = -1;
  if (ClearedError<Api>(Api::GetDevice(&current)) == cudaSuccess && current == device) return true;
  return ClearedError<Api>(Api::SetDevice(device)) == cudaSuccess;
}

}  // namespace logprob::cuda
