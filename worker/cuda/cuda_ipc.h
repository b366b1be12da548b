// Mapping a same-host client's CUDA allocation into a worker (CUDA IPC
// inputs: WorkItem.payload_cuda_ipc_*, public Tensor.cuda_ipc).
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "worker/scoring/backend.h"

namespace logprob::cuda {

/// Maps bytes [offset, offset + bytes) of the allocation a client exported
/// with cudaIpcGetMemHandle (`handle`: the 64-byte cudaIpcMemHandle_t of the
/// allocation's base) into `device`'s context (cudaSetDevice, then
/// cudaIpcOpenMemHandle with cudaIpcMemLazyEnablePeerAccess, so a client GPU
/// other than `device` is read over peer access). Returns a device pointer
/// to byte `offset`; the allocation stays mapped while a copy of it (or of
/// another DevicePayload of the same handle on the same device) lives, and
/// the last one unmaps it (cudaIpcCloseMemHandle). The range is checked
/// (CudaIpcRangeLimit) against `allocation_bytes`, the allocation's size
/// the client sent (0: not given), and against the mapping's size
/// (cuMemGetAddressRange through cudaGetDriverEntryPointByVersion, which
/// may be rounded up to whole pages), so a bad reference cannot make a
/// kernel read past the client's allocation. Without allocation_bytes the
/// mapping alone bounds the range, and for a small cudaMalloc that the
/// runtime sub-allocated from a larger block (2 MiB) the mapping is that
/// whole block: a range past the allocation but inside the block passes
/// (it reads the client's own memory). The Python client always sends
/// allocation_bytes (its own cuMemGetAddressRange).
/// Errors: INVALID_ARGUMENT for a handle that is not 64 bytes, a negative
/// offset or size, an allocation_bytes larger than the mapping, or a range
/// past the allocation's end;
/// FAILED_PRECONDITION when the device cannot be selected or the handle
/// cannot be opened (a client on another host or in another container, a
/// freed allocation, a GPU this worker cannot reach), or the allocation's
/// size cannot be queried. A failed CUDA call's error is cleared
/// (cudaGetLastError) so it does not surface in later kernels.
/// Thread-safe.
absl::StatusOr<DevicePayload> OpenCudaIpc(int device, std::string_view handle, int64_t offset, int64_t bytes,
                                          int64_t allocation_bytes = 0);

/// The bytes of a CUDA IPC allocation a reference may use: `sent` (the
/// allocation's size the client sent), or `mapped` (the importer's mapping
/// from the handle's base, possibly rounded up to whole pages) when `sent`
/// is 0. INVALID_ARGUMENT when `sent` is negative or larger than `mapped`
/// (the client's figure is wrong: the range cannot be trusted), or when
/// bytes [offset, offset + bytes) do not lie within the limit. Pure;
/// thread-safe.
absl::StatusOr<int64_t> CudaIpcRangeLimit(int64_t offset, int64_t bytes, int64_t mapped, int64_t sent);

}  // namespace logprob::cuda
