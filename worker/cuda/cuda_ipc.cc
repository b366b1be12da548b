#include "worker/cuda/cuda_ipc.h"

#include <cuda.h>  // CUresult, CUdeviceptr (types only: no libcuda link)
#include <cuda_runtime.h>

#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace logprob::cuda {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "cudaIpcMemHandle_t is 64 bytes");

using AddressRangeFn = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

/// cuMemGetAddressRange from the driver the runtime loaded; null if missing.
AddressRangeFn AddressRange() {
  static const AddressRangeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<AddressRangeFn>(nullptr);
    }
    return reinterpret_cast<AddressRangeFn>(p);
  }();
  return fn;
}

/// The error of a failed CUDA call, which is then cleared.
std::string Failed(const char* call, cudaError_t e) {
  cudaGetLastError();
  return absl::StrCat(call, ": ", cudaGetErrorString(e));
}

/// Handles mapped in this process, by (device, handle): a mapping lives
/// while a DevicePayload of it does. An entry whose mapping expired is
/// being closed; Open waits for its deleter to remove it rather than open
/// the handle a second time meanwhile.
struct Mappings {
  absl::Mutex mu;
  absl::CondVar closed;  // signalled when an entry goes
  std::map<std::pair<int, std::string>, std::weak_ptr<const char>> open ABSL_GUARDED_BY(mu);
};

Mappings& Registry() {
  static auto* m = new Mappings;  // never destroyed: deleters may run at exit
  return *m;
}

}  // namespace

absl::StatusOr<int64_t> CudaIpcRangeLimit(int64_t offset, int64_t bytes, int64_t mapped, int64_t sent) {
  if (sent < 0 || sent > mapped)
    return absl::InvalidArgumentError(absl::StrCat("CUDA IPC input: the client says its allocation has ", sent,
                                                   " bytes, but the mapping of its handle has ", mapped));
  const int64_t limit = sent > 0 ? sent : mapped;
  if (offset < 0 || bytes < 0 || offset > limit || bytes > limit - offset)
    return absl::InvalidArgumentError(absl::StrCat("CUDA IPC input: bytes [", offset, ", ", offset, " + ", bytes,
                                                   ") are outside the client's allocation of ", limit, " bytes",
                                                   sent > 0 ? "" : " (as mapped here; the client sent no size)"));
  return limit;
}

absl::StatusOr<DevicePayload> OpenCudaIpc(int device, std::string_view handle, int64_t offset, int64_t bytes,
                                          int64_t allocation_bytes) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    return absl::InvalidArgumentError(absl::StrCat("CUDA IPC input: the handle is ", handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t is ", sizeof(cudaIpcMemHandle_t)));
  if (offset < 0 || bytes < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA IPC input: offset ", offset, " and size ", bytes, " must be >= 0"));
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC input: ", Failed(absl::StrCat("cudaSetDevice(", device, ")").c_str(), e)));
  const AddressRangeFn range = AddressRange();
  if (range == nullptr)
    return absl::FailedPreconditionError(
        "CUDA IPC input: the driver has no cuMemGetAddressRange, so the reference's range cannot be checked");

  Mappings& reg = Registry();
  auto key = std::make_pair(device, std::string(handle));
  std::shared_ptr<const char> base;  // destroyed after the lock is released (its deleter takes it)
  {
    absl::MutexLock lock(&reg.mu);
    for (;;) {
      auto it = reg.open.find(key);
      if (it == reg.open.end()) break;
      base = it->second.lock();
      if (base) break;
      reg.closed.Wait(&reg.mu);  // its last user is closing it
    }
    if (!base) {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handle.data(), sizeof(h));
      void* ptr = nullptr;
      if (const cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
        return absl::FailedPreconditionError(absl::StrCat(
            "CUDA IPC input: ", Failed("cudaIpcOpenMemHandle", e),
            " (the client must be on this host, outside a separate container or with its IPC namespace shared, "
            "keep the allocation alive until the reply, and its GPU must be visible to the worker)"));
      base = std::shared_ptr<const char>(static_cast<const char*>(ptr), [device, key](const char* p) {
        Mappings& r = Registry();
        absl::MutexLock l(&r.mu);
        auto it = r.open.find(key);
        if (it != r.open.end() && it->second.expired()) r.open.erase(it);
        cudaSetDevice(device);
        if (const cudaError_t e = cudaIpcCloseMemHandle(const_cast<char*>(p)); e != cudaSuccess)
          std::cerr << "logprob-worker: CUDA IPC input: " << Failed("cudaIpcCloseMemHandle", e) << std::endl;
        r.closed.SignalAll();
      });
      reg.open[key] = base;
    }
  }
  CUdeviceptr alloc_base = 0;
  size_t alloc_size = 0;
  const auto at = reinterpret_cast<CUdeviceptr>(base.get());
  if (const CUresult r = range(&alloc_base, &alloc_size, at); r != CUDA_SUCCESS)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC input: cuMemGetAddressRange of the mapped allocation failed (CUresult ", r, ")"));
  // The mapping from the handle's base: the allocation, or the whole block
  // a small allocation was sub-allocated from (cuda_ipc.h): only the size
  // the client sent (allocation_bytes) bounds the range exactly then.
  const auto mapped = static_cast<int64_t>(alloc_size - (at - alloc_base));
  LOGPROB_RETURN_IF_ERROR(CudaIpcRangeLimit(offset, bytes, mapped, allocation_bytes).status());
  return DevicePayload(base, base.get() + offset);
}

}  // namespace logprob::cuda
