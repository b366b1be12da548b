// Device memory into a file: how a worker stages the rows of an lm_head
// update that a same-host client sent as a CUDA IPC handle
// (Worker.StageLmHeadRows) into the update's store file, which the
// front-end hashes and every worker later loads its slice from. The
// chunking and the error handling live here, on a DeviceCopy, so they run
// in CPU tests (tests/fake_device_copy.h); the CUDA copy is
// worker/cuda/cuda_device_copy.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/comm/host_staged_device_collectives.h"

namespace logprob {

/// Host bytes one device-to-host copy (and one pwrite) of
/// CopyDeviceToFile moves at most by default.
inline constexpr size_t kDeviceFileChunkBytes = size_t{16} << 20;

/// Copies `bytes` bytes of device memory at `device` into file descriptor
/// `fd` at byte `file_offset`: chunk by chunk (at most `chunk_bytes` each)
/// into `*buffer` (host memory, grown to min(bytes, chunk_bytes) and kept
/// for the next call) with copy.ToHost, then written with PwriteAll. Any
/// byte layout (the bytes are copied as they are). OK only when every byte
/// has been written; on an error the file may hold a prefix of them, and
/// the caller must not count any of them. Errors: INVALID_ARGUMENT for
/// chunk_bytes == 0 or a null `device` with bytes > 0; RESOURCE_EXHAUSTED
/// when the host buffer cannot be had; the copy's error (INTERNAL: a
/// device error) with the failing chunk named; INTERNAL with errno's text
/// when a write fails (e.g. ENOSPC on /dev/shm). Thread-safe for distinct
/// buffers (the DeviceCopy must be; file ranges of concurrent calls should
/// not overlap).
absl::Status CopyDeviceToFile(DeviceCopy& copy, const void* device, size_t bytes, int fd, uint64_t file_offset,
                              std::vector<char>* buffer, size_t chunk_bytes = kDeviceFileChunkBytes);

}  // namespace logprob
