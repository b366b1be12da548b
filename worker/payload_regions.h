// The worker's side of shared-memory payloads (WorkItem.payload_shm).
#pragma once

#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/shared_memory.h"
#include "logprob/internal/v1/worker.pb.h"
#include "worker/backend.h"

namespace logprob {

/// Maps the front-end's payload regions read-only and keeps the last
/// `capacity` mappings (the front-end reuses its regions: server/payload_pool.h),
/// so a region is mapped once, not per work item. Thread-safe.
class PayloadRegions {
 public:
  /// `backend` (optional, must outlive this) is told about every region
  /// mapped (ScoringBackend::RegisterHostMemory, e.g. cudaHostRegister) and
  /// unmapped, so it can upload from the regions directly.
  explicit PayloadRegions(size_t capacity = 8, ScoringBackend* backend = nullptr)
      : capacity_(capacity), backend_(backend) {}

  /// The payload of `item`: its logits (or, for HIDDEN_STATES, its
  /// hidden_states) field, or its range of the region payload_shm. *hold
  /// keeps that region mapped while the payload is in use.
  /// FAILED_PRECONDITION when the region cannot be opened (a worker on
  /// another host); INVALID_ARGUMENT when the range is outside it.
  absl::StatusOr<std::string_view> Payload(const internal::v1::WorkItem& item, std::shared_ptr<SharedRegion>* hold);

 private:
  const size_t capacity_;
  ScoringBackend* const backend_;
  std::mutex mu_;
  std::list<std::shared_ptr<SharedRegion>> mapped_;  // most recently used first
};

}  // namespace logprob
