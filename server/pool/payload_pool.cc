#include "server/pool/payload_pool.h"

#include <algorithm>

#include "common/status_macros.h"

namespace logprob {

PayloadPool::PayloadPool(int max_idle, int64_t max_idle_bytes) : state_(std::make_shared<State>()) {
  state_->max_idle = max_idle;
  state_->max_idle_bytes = max_idle_bytes;
}

size_t PayloadPool::RegionSize(size_t bytes) {
  size_t size = size_t{1} << 20;
  while (size < bytes) size *= 2;
  return size;
}

int64_t PayloadPool::idle_bytes() const {
  absl::MutexLock lock(&state_->mu);
  int64_t bytes = 0;
  for (const auto& r : state_->idle) bytes += static_cast<int64_t>(r->size());
  return bytes;
}

absl::StatusOr<std::shared_ptr<SharedRegion>> PayloadPool::Acquire(size_t bytes) {
  std::unique_ptr<SharedRegion> region;
  {
    absl::MutexLock lock(&state_->mu);
    auto& idle = state_->idle;
    auto best = idle.end();
    for (auto it = idle.begin(); it != idle.end(); ++it)
      if ((*it)->size() >= bytes && (best == idle.end() || (*it)->size() < (*best)->size())) best = it;
    if (best != idle.end()) {
      region = std::move(*best);
      idle.erase(best);
    }
  }
  if (!region) {
    LOGPROB_ASSIGN_OR_RETURN(region, SharedRegion::Create(RegionSize(bytes)));
  }
  std::weak_ptr<State> home = state_;
  return std::shared_ptr<SharedRegion>(region.release(), [home](SharedRegion* r) {
    std::unique_ptr<SharedRegion> owned(r);
    auto state = home.lock();
    if (!state) return;
    absl::MutexLock lock(&state->mu);
    state->idle.push_back(std::move(owned));
    int64_t idle_bytes = 0;
    for (const auto& region : state->idle) idle_bytes += static_cast<int64_t>(region->size());
    while (!state->idle.empty() &&
           (static_cast<int>(state->idle.size()) > state->max_idle || idle_bytes > state->max_idle_bytes)) {
      // Release the smallest: large requests are the ones shared memory helps.
      auto smallest = std::min_element(state->idle.begin(), state->idle.end(),
                                       [](const auto& a, const auto& b) { return a->size() < b->size(); });
      idle_bytes -= static_cast<int64_t>((*smallest)->size());
      state->idle.erase(smallest);
    }
  });
}

}  // namespace logprob
