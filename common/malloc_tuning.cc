#include "common/malloc_tuning.h"

#include <malloc.h>

#include <algorithm>
#include <climits>

namespace logprob {

void KeepFreedMemory(int64_t keep_bytes) {
  if (keep_bytes <= 0) return;
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<int64_t>(keep_bytes, INT_MAX)));
}

}  // namespace logprob
