#include "server/heads/version_releases.h"

#include <utility>

namespace logprob {

void LmHeadReleases::Push(const LmHeadVersion& version) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(version);
}

std::vector<LmHeadVersion> LmHeadReleases::Take() {
  absl::MutexLock lock(&mu_);
  return std::exchange(queue_, {});
}

VersionReleases::VersionReleases(std::shared_ptr<LmHeadReleases> queue, LmHeadStore* store,
                                 std::function<bool(const internal::v1::LmHeadRef&)> drop)
    : queue_(std::move(queue)), store_(store), drop_(std::move(drop)) {}

void VersionReleases::Release() {
  // One caller at a time: a Begin's Release returns only after versions
  // the thread's took are recycled (their files can take its rows).
  absl::MutexLock lock(&mu_);
  for (const LmHeadVersion& v : queue_->Take()) {
    const bool dropped = !drop_ || drop_(v.Ref());
    if (v.origin == kUpdateOrigin) store_->Recycle(v, dropped);
  }
}

void VersionReleases::Tidy() {
  Release();
  store_->Tidy();
}

}  // namespace logprob
