#include "common/buffer_pool.h"

#include <algorithm>

namespace logprob {

std::string BufferPool::Acquire(size_t bytes) {
  std::string buffer;
  {
    absl::MutexLock lock(&mu_);
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it)
      if (it->capacity() >= bytes && (best == idle_.end() || it->capacity() < best->capacity())) best = it;
    if (best != idle_.end()) {
      buffer.swap(*best);
      idle_.erase(best);
      idle_bytes_ -= static_cast<int64_t>(buffer.capacity());
    }
  }
  // Within the capacity resize() only writes the bytes past the old size.
  buffer.resize(bytes);
  return buffer;
}

void BufferPool::Release(std::string buffer) {
  const int64_t cap = static_cast<int64_t>(buffer.capacity());
  if (cap == 0 || cap > max_idle_bytes_) return;
  absl::MutexLock lock(&mu_);
  idle_.push_back(std::move(buffer));
  idle_bytes_ += cap;
  // Over the bound: drop the smallest buffers first.
  while (idle_bytes_ > max_idle_bytes_) {
    auto smallest = std::min_element(idle_.begin(), idle_.end(), [](const std::string& a, const std::string& b) {
      return a.capacity() < b.capacity();
    });
    idle_bytes_ -= static_cast<int64_t>(smallest->capacity());
    idle_.erase(smallest);
  }
}

int64_t BufferPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

}  // namespace logprob
