// Keeping large freed buffers mapped (glibc malloc), so a process that
// moves large gRPC messages reuses their pages instead of faulting in
// fresh ones for every message.
//
// Why: glibc serves allocations over its mmap threshold (at most 32 MiB)
// with a fresh mmap and returns them with munmap on free, and a thread's
// own arena does the same for anything over its 64 MiB heap. Every large
// message (the receiver's parsed bytes field, a chunked request's buffer)
// then pays one page fault per 4 KiB page: about 6 us on the benchmark
// machine, 100 ms per 64 MiB, which cut large single messages from about
// 1.4 GB/s to 0.3-0.4 GB/s (docs/benchmarks.md "Large requests").
#pragma once

#include <cstdint>

namespace logprob {

/// Makes malloc keep freed memory for reuse: no mmap'd chunks
/// (M_MMAP_MAX 0), one arena (M_ARENA_MAX 1, so large blocks come from
/// the main heap and are reused by every thread), and the heap's free top
/// returned to the OS only beyond `keep_bytes` (M_TRIM_THRESHOLD).
/// `keep_bytes` <= 0 does nothing (glibc's defaults). Call at the start of
/// main, before threads exist. Not thread-safe.
void KeepFreedMemory(int64_t keep_bytes);

}  // namespace logprob
