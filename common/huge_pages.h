// Transparent huge pages for large, long-lived host buffers.
#pragma once

#include <cstddef>

namespace logprob {

/// Asks the kernel to back [p, p + bytes) with transparent huge pages
/// (madvise MADV_HUGEPAGE on the 2 MiB-aligned part of the range), before
/// the memory is first touched: a 593 MiB lm_head slice then takes about
/// 300 page faults instead of 150,000 (each costs microseconds on a VM;
/// docs/benchmarks.md "lm_head updates"). Meant for buffers filled once
/// and kept (a worker's lm_head slice). Best effort: does nothing for
/// ranges under 4 MiB, and where THP is off ("never") or madvise fails the
/// memory simply stays in 4 KiB pages. Thread-safe.
void AdviseHugePages(void* p, size_t bytes);

}  // namespace logprob
