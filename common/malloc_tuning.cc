#include "common/malloc_tuning.h"

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <fstream>
#include <mutex>
#include <string>

namespace logprob {
namespace {

std::atomic<int64_t> g_keep_bytes{0};  // KeepFreedMemory's cap; 0: none
std::mutex g_trim_mu;                  // one TrimKeptFreedMemory at a time

/// RssAnon of /proc/self/status, bytes (0 if unreadable).
int64_t ResidentAnonymousBytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "RssAnon:") {
      int64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 20, '\n');
  }
  return 0;
}

}  // namespace

void KeepFreedMemory(int64_t keep_bytes) {
  if (keep_bytes <= 0) return;
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<int64_t>(keep_bytes, INT_MAX)));
  g_keep_bytes = keep_bytes;
}

int64_t KeptFreedBytes() {
  const struct mallinfo2 info = mallinfo2();
  const auto in_use = static_cast<int64_t>(info.uordblks + info.hblkhd);  // heap blocks and mmap'd ones
  return std::max<int64_t>(0, ResidentAnonymousBytes() - in_use);
}

bool TrimKeptFreedMemory() {
  const int64_t keep = g_keep_bytes.load();
  if (keep <= 0) return false;
  std::unique_lock<std::mutex> lock(g_trim_mu, std::try_to_lock);
  if (!lock.owns_lock() || KeptFreedBytes() <= keep) return false;
  malloc_trim(0);
  return true;
}

}  // namespace logprob
