// RAII owners of device memory, pinned host memory, streams and events,
// and the CUDA-error -> absl::Status mapping of the CUDA backend.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/buffer_recycler.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_error.h"

namespace logprob::cuda {

/// OK, or an error naming `what` and the CUDA error: UNAVAILABLE for a
/// sticky error (IsStickyError<Errors>: the context is broken for good;
/// StickyErrorSeen() is set, so the worker answers UNAVAILABLE and the
/// pool re-forms with a fresh process), else INTERNAL. Thread-safe.
template <typename Errors>
absl::Status CudaStatusOf(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  if (IsStickyError<Errors>(e)) {
    StickyErrorSeen().store(true);
    return absl::UnavailableError(absl::StrCat("CUDA device fault in ", what, ": ", cudaGetErrorName(e), " (",
                                               cudaGetErrorString(e),
                                               "); the CUDA context is unusable, the worker leaves the pool"));
  }
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

/// CudaStatusOf with the CUDA runtime's own last error.
inline absl::Status CudaStatus(cudaError_t e, const char* what) { return CudaStatusOf<CudaRuntimeErrors>(e, what); }

/// Returns the Status of a CUDA call from the enclosing function on error.
#define LOGPROB_CUDA_RETURN_IF_ERROR(call, what) LOGPROB_RETURN_IF_ERROR(::logprob::cuda::CudaStatus((call), what))

/// Memory that grows on demand (contents are lost on growth), allocated
/// and freed by `Alloc`'s static Allocate / Free. `Errors` is the
/// runtime's last-error call (cuda_error.h; a fake in tests).
template <typename Alloc, typename Errors = CudaRuntimeErrors>
class GrowingBuffer {
 public:
  GrowingBuffer() = default;
  GrowingBuffer(const GrowingBuffer&) = delete;
  GrowingBuffer& operator=(const GrowingBuffer&) = delete;
  ~GrowingBuffer() { Alloc::Free(ptr_); }
  /// Ensures at least `bytes` bytes. INTERNAL when the allocation fails;
  /// the buffer is then empty and the failure is not left behind as the
  /// thread's last CUDA error (ClearedError), so the next kernel launch
  /// does not report it as its own.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= size_) return absl::OkStatus();
    Alloc::Free(ptr_);
    ptr_ = nullptr;
    size_ = 0;
    LOGPROB_RETURN_IF_ERROR(CudaStatusOf<Errors>(ClearedError<Errors>(Alloc::Allocate(&ptr_, bytes)), Alloc::kName));
    size_ = bytes;
    return absl::OkStatus();
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

/// cudaMalloc / cudaFree.
struct DeviceAlloc {
  static constexpr const char* kName = "cudaMalloc";
  static cudaError_t Allocate(void** p, size_t n) { return cudaMalloc(p, n); }
  static void Free(void* p) { cudaFree(p); }
};
/// cudaMallocHost / cudaFreeHost (page-locked).
struct PinnedAlloc {
  static constexpr const char* kName = "cudaMallocHost";
  static cudaError_t Allocate(void** p, size_t n) { return cudaMallocHost(p, n); }
  static void Free(void* p) { cudaFreeHost(p); }
};

/// cudaMalloc / cudaFree on the current device, as BufferRecycler's
/// allocator: a failed allocation is INTERNAL (or UNAVAILABLE when sticky)
/// and is not left behind as the thread's last CUDA error.
struct RecyclableDeviceAlloc {
  static absl::Status Allocate(void** p, size_t n) { return CudaStatus(ClearedError(cudaMalloc(p, n)), "cudaMalloc"); }
  static void Free(void* p) { cudaFree(p); }
};
/// Device buffers of released lm_head versions kept for the next version
/// of the same size (no cudaMalloc per update).
using DeviceRecycler = BufferRecycler<RecyclableDeviceAlloc>;

/// Device memory that grows on demand.
using DeviceBuffer = GrowingBuffer<DeviceAlloc>;
/// Page-locked host memory that grows on demand (async copies to and from
/// it overlap with host work).
using PinnedBuffer = GrowingBuffer<PinnedAlloc>;

/// A non-blocking stream.
class Stream {
 public:
  Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  absl::Status Create() { return CudaStatus(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "stream"); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

/// An event without timing.
class Event {
 public:
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  absl::Status Create() { return CudaStatus(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "event"); }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

/// Copies `bytes` from host memory `src` (pageable or page-locked) to
/// device memory `dst` and returns once the data is on the device. A plain
/// cudaMemcpy from pageable memory may return once the bytes are staged,
/// before the DMA lands, and the backend's streams are non-blocking (not
/// ordered after the legacy stream), so this copies on a stream of its own
/// and synchronises that stream: other streams' work is not waited for.
/// INTERNAL on a CUDA error. Thread-safe.
inline absl::Status UploadAndWait(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  Stream s;
  LOGPROB_RETURN_IF_ERROR(s.Create());
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s.get()), "upload");
  return CudaStatus(cudaStreamSynchronize(s.get()), "upload");
}

/// Sets `bytes` of device memory at `dst` to zero and returns once done
/// (on a stream of its own, as UploadAndWait). INTERNAL on a CUDA error.
/// Thread-safe.
inline absl::Status ZeroAndWait(void* dst, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  Stream s;
  LOGPROB_RETURN_IF_ERROR(s.Create());
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, 0, bytes, s.get()), "zero fill");
  return CudaStatus(cudaStreamSynchronize(s.get()), "zero fill");
}

}  // namespace logprob::cuda
