#include "worker/scoring/payload_regions.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/untrusted_text.h"

namespace logprob {

int PayloadRegions::ForgetRetired() {
  std::vector<std::shared_ptr<SharedRegion>> retired;  // unmapped after the lock, once nobody holds them
  {
    absl::MutexLock lock(&mu_);
    for (auto it = mapped_.begin(); it != mapped_.end();) {
      if (SharedObjectExists((*it)->name())) {
        ++it;
      } else {
        retired.push_back(std::move(*it));
        it = mapped_.erase(it);
      }
    }
  }
  return static_cast<int>(retired.size());
}

size_t PayloadRegions::mapped() const {
  absl::MutexLock lock(&mu_);
  return mapped_.size();
}

absl::StatusOr<std::string_view> PayloadRegions::Payload(const internal::v1::WorkItem& item,
                                                         std::shared_ptr<SharedRegion>* hold) {
  if (!item.has_shared_memory()) return std::string_view(item.data());
  const internal::v1::SharedMemoryPayload& shm = item.shared_memory();
  if (!IsPoolRegionName(shm.name(), prefix_))
    return absl::PermissionDeniedError(absl::StrCat("work item payload in shared memory ", Printable(shm.name()),
                                                    ": not one of the front-end's payload regions (",
                                                    prefix_.empty() ? "/logprob-<pid>-<n>" : prefix_ + "<n>", ")"));
  ForgetRetired();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = mapped_.begin(); it != mapped_.end(); ++it)
      if ((*it)->name() == shm.name()) {
        *hold = *it;
        mapped_.splice(mapped_.begin(), mapped_, it);
        break;
      }
  }
  if (!*hold) {
    auto opened = SharedRegion::Open(shm.name());
    if (!opened.ok())
      return absl::FailedPreconditionError(absl::StrCat(
          "work item payload in shared memory: ", opened.status().message(),
          " (is this worker on the front-end's host? otherwise start the server with --shared-memory=false)"));
    *hold = std::move(*opened);
    if (backend_) {
      // The backend forgets the region before it is unmapped: the returned
      // pointer's deleter unregisters, then drops the mapping it owns.
      std::shared_ptr<SharedRegion> mapped = std::move(*hold);
      backend_->RegisterHostMemory(mapped->data(), mapped->size());
      ScoringBackend* backend = backend_;
      *hold = std::shared_ptr<SharedRegion>(mapped.get(), [mapped, backend](SharedRegion* r) mutable {
        backend->UnregisterHostMemory(r->data());
        mapped.reset();
      });
    }
    absl::MutexLock lock(&mu_);
    mapped_.push_front(*hold);
    if (mapped_.size() > capacity_) mapped_.pop_back();
  }
  const int64_t offset = shm.offset(), bytes = shm.byte_size();
  const auto size = static_cast<int64_t>((*hold)->size());
  if (offset < 0 || bytes < 0 || offset > size || bytes > size - offset)
    return absl::InvalidArgumentError(absl::StrCat("work item: payload of ", bytes, " bytes at offset ", offset,
                                                   " is outside shared memory ", Printable(shm.name()), " of ", size,
                                                   " bytes"));
  return std::string_view((*hold)->data() + offset, static_cast<size_t>(bytes));
}

}  // namespace logprob
