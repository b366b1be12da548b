#include "server/payload_pool.h"

#include <algorithm>

#include "common/status_macros.h"

namespace logprob {

PayloadPool::PayloadPool(int max_idle) : state_(std::make_shared<State>()) { state_->max_idle = max_idle; }

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
    size_t size = size_t{1} << 20;
    while (size < bytes) size *= 2;
    LOGPROB_ASSIGN_OR_RETURN(region, SharedRegion::Create(size));
  }
  std::weak_ptr<State> home = state_;
  return std::shared_ptr<SharedRegion>(region.release(), [home](SharedRegion* r) {
    std::unique_ptr<SharedRegion> owned(r);
    auto state = home.lock();
    if (!state) return;
    absl::MutexLock lock(&state->mu);
    state->idle.push_back(std::move(owned));
    if (static_cast<int>(state->idle.size()) > state->max_idle) {
      // Release the smallest: large requests are the ones shared memory helps.
      auto smallest = std::min_element(state->idle.begin(), state->idle.end(),
                                       [](const auto& a, const auto& b) { return a->size() < b->size(); });
      state->idle.erase(smallest);
    }
  });
}

}  // namespace logprob
