// Keeping large freed buffers mapped (glibc malloc), so a process that
// moves large gRPC messages reuses their pages instead of faulting in
// fresh ones for every message, and capping what it keeps.
//
// Why: glibc serves allocations over its mmap threshold (at most 32 MiB)
// with a fresh mmap and returns them with munmap on free, and a thread's
// own arena does the same for anything over its 64 MiB heap. Every large
// message (the receiver's parsed bytes field, a chunked request's buffer)
// then pays one page fault per 4 KiB page: about 6 us on the benchmark
// machine, 100 ms per 64 MiB, which cut large single messages from about
// 1.4 GB/s to 0.3-0.4 GB/s (docs/benchmarks.md "Large requests").
//
// The cap: glibc's trim threshold only returns the free top of the heap;
// blocks freed between live ones stay resident, so concurrent large
// messages left far more freed memory resident than the setting (issue 32:
// 642 MiB against 128 MiB). TrimKeptFreedMemory measures what is really
// kept and returns it when it is over the setting.
#pragma once

#include <cstdint>

namespace logprob {

/// Makes malloc keep freed memory for reuse: no mmap'd chunks
/// (M_MMAP_MAX 0), one arena (M_ARENA_MAX 1, so large blocks come from
/// the main heap and are reused by every thread), and the heap's free top
/// returned to the OS only beyond `keep_bytes` (M_TRIM_THRESHOLD); also
/// the cap TrimKeptFreedMemory keeps to. `keep_bytes` <= 0 does nothing
/// (glibc's defaults). Call at the start of main, before threads exist.
/// Not thread-safe.
void KeepFreedMemory(int64_t keep_bytes);

/// Freed memory malloc keeps resident, bytes >= 0: the process's resident
/// anonymous memory (RssAnon of /proc/self/status) minus malloc's bytes in
/// use (mallinfo2 uordblks + hblkhd). An upper estimate: other anonymous memory
/// (thread stacks, a few MiB) counts too. Thread-safe; reads /proc.
int64_t KeptFreedBytes();

/// When KeepFreedMemory set a cap and KeptFreedBytes() exceeds it, returns
/// the heap's free pages to the OS (malloc_trim: the free top and the free
/// pages between live blocks, madvise MADV_DONTNEED) and returns true;
/// else false. Call where large buffers were just freed or are about to be
/// allocated (the server: around each large request), and now and then
/// (the server: once a second, for what was freed after the last large
/// request). Thread-safe: one caller measures and trims at a time, others
/// return false at once.
bool TrimKeptFreedMemory();

}  // namespace logprob
