// Whole positioned reads and writes of a file descriptor.
#pragma once

#include <cstddef>
#include <cstdint>

namespace logprob {

/// Reads exactly `n` bytes at `offset` of `fd` into `p` (pread, retried on
/// EINTR and short reads). False at end of file or on an error (errno
/// says which; 0 at end of file is left as it was). Thread-safe for
/// concurrent calls on one descriptor.
bool PreadAll(int fd, char* p, size_t n, uint64_t offset);

/// Writes exactly `n` bytes of `p` at `offset` of `fd` (pwrite, retried on
/// EINTR and short writes). False on an error (errno says which).
/// Thread-safe for concurrent calls on one descriptor.
bool PwriteAll(int fd, const char* p, size_t n, uint64_t offset);

}  // namespace logprob
