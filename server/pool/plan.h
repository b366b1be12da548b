// A job split over the workers: what the planner (server/core/planner.h)
// builds and the worker pool (server/pool/worker_pool.h) runs.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/shared_memory.h"
#include "logprob/internal/v1/worker.pb.h"

namespace logprob {

/// One worker's share of a job; its result rows start at global row
/// `row_offset + result.row_begin`.
struct PlannedItem {
  int worker = 0;
  int64_t row_offset = 0;
  internal::v1::WorkItem item;
};

/// The split of a job over `workers` workers.
struct Plan {
  internal::v1::Layout layout = internal::v1::TOKEN_PARALLEL;
  std::vector<PlannedItem> items;
  /// Holds the items' payloads when they travel through shared memory;
  /// the region goes back to its PayloadPool when the plan goes.
  std::shared_ptr<SharedRegion> payload_region;
};

}  // namespace logprob
