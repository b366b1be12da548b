#include "server/transport/first_part_watch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace logprob {

FirstPartWatch::FirstPartWatch(int max_waiting, std::chrono::milliseconds timeout)
    : max_waiting_(max_waiting), timeout_(timeout), thread_([this] { Loop(); }) {}

FirstPartWatch::~FirstPartWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.Signal();
  }
  thread_.join();
}

FirstPartWatch::Waiting::~Waiting() {
  if (owner_ == nullptr) return;
  absl::MutexLock lock(&owner_->mu_);
  owner_->waiting_.erase(key_);
}

absl::StatusOr<FirstPartWatch::Waiting> FirstPartWatch::Watch(grpc::ServerContext* context, const char* method) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(waiting_.size()) >= max_waiting_)
    return absl::ResourceExhaustedError(
        absl::StrCat(method, ": ", waiting_.size(),
                     " calls are waiting for their first message; send it with the call, or retry with backoff"));
  const int64_t key = next_key_++;
  waiting_[key] = Entry{context, Clock::now() + timeout_};
  changed_.Signal();
  return Waiting(this, key);
}

void FirstPartWatch::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    // Cancelled calls stay counted until their handlers see their reads end.
    const Clock::time_point now = Clock::now();
    Clock::time_point next = Clock::time_point::max();
    for (auto& [key, e] : waiting_) {
      if (e.context == nullptr) continue;
      if (e.deadline <= now) {
        e.context->TryCancel();
        e.context = nullptr;
      } else {
        next = std::min(next, e.deadline);
      }
    }
    changed_.WaitWithDeadline(
        &mu_, next == Clock::time_point::max() ? absl::InfiniteFuture() : absl::Now() + absl::FromChrono(next - now));
  }
}

}  // namespace logprob
