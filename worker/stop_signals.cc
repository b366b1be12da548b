#include "worker/stop_signals.h"

namespace logprob {

void StopSignals::Stop(uint64_t run_id) {
  absl::MutexLock lock(&mu_);
  if (!ids_.insert(run_id).second) return;
  order_.push_back(run_id);
  if (order_.size() > capacity_) {
    ids_.erase(order_.front());
    order_.pop_front();
  }
}

bool StopSignals::Stopped(uint64_t run_id) const {
  absl::MutexLock lock(&mu_);
  return ids_.count(run_id) != 0;
}

}  // namespace logprob
