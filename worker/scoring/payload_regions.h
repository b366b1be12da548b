// The worker's side of shared-memory payloads (WorkItem.shared_memory).
#pragma once

#include <list>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"
#include "logprob/internal/v1/worker.pb.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// Maps the front-end's payload regions read-only and keeps the last
/// `capacity` mappings (the front-end reuses its regions: server/pool/payload_pool.h),
/// so a region is mapped once, not per work item. A region the front-end
/// retired (unlinked: its pool let it go) is unmapped at the next work item
/// (or Forget call), once no item in flight holds it, so its pages go back
/// to the system instead of staying mapped here. Thread-safe.
class PayloadRegions {
 public:
  /// `backend` (optional, must outlive this) is told about every region
  /// mapped (ScoringBackend::RegisterHostMemory, e.g. cudaHostRegister) and
  /// unmapped, so it can upload from the regions directly.
  /// Only regions named `prefix` + digits are opened (IsPoolRegionName:
  /// the front-end's JoinReply.payload_region_prefix; empty: any
  /// front-end's "/logprob-<pid>-<n>"), never a client's region or another
  /// object of this user's.
  explicit PayloadRegions(size_t capacity = 8, ScoringBackend* backend = nullptr, std::string prefix = "")
      : capacity_(capacity), backend_(backend), prefix_(std::move(prefix)) {}

  /// The payload of `item` read on the host: its bytes (WorkItem.data), or
  /// its range of the front-end's region (WorkItem.shared_memory). *hold
  /// keeps that region mapped while the payload is in use.
  /// FAILED_PRECONDITION when the region cannot be opened (a worker on
  /// another host); INVALID_ARGUMENT when the range is outside it;
  /// PERMISSION_DENIED for a name that is not one of the front-end's
  /// payload regions (nothing is opened).
  absl::StatusOr<std::string_view> Payload(const internal::v1::WorkItem& item, std::shared_ptr<SharedRegion>* hold)
      ABSL_LOCKS_EXCLUDED(mu_);

  /// Forgets the mappings of regions the front-end has unlinked
  /// (SharedObjectExists); returns how many. Called by Payload.
  int ForgetRetired() ABSL_LOCKS_EXCLUDED(mu_);
  /// Regions kept mapped for reuse now.
  size_t mapped() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t capacity_;
  ScoringBackend* const backend_;
  const std::string prefix_;
  mutable absl::Mutex mu_;
  std::list<std::shared_ptr<SharedRegion>> mapped_ ABSL_GUARDED_BY(mu_);  // most recently used first
};

}  // namespace logprob
