// Resolution of a ScoreRequest's shared-memory references (Tensor.shared_memory)
// into the byte views BuildScoreJob validates, so batching, planning and
// replies work as for inline bytes.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"
#include "server/client_regions.h"

namespace logprob {

/// A request's input bytes: data[i] is input i's bytes. Inline tensors
/// view their `data`; integer tensors (input_ids, cu_seqlens, ...) in a
/// region are copied into `owned` (they are small, and validation reads
/// them); the logits / hidden_states in a region stay there: their view
/// is an address range of the region (ClientRegion::base) that only
/// `rows_source` may read.
struct ResolvedInputs {
  std::vector<std::string_view> data;
  std::vector<std::unique_ptr<std::string>> owned;
  std::shared_ptr<RegionReader> rows_source;  // null unless logits / hidden_states are in a region
  int64_t referenced_bytes = 0;               // bytes of all references
};

/// True if some input of `req` references shared memory.
bool HasSharedMemoryRefs(const v1::ScoreRequest& req);

/// Resolves the references of `req` against session `owner`'s regions.
/// Errors name the tensor: NOT_FOUND (region not registered by the
/// session), INVALID_ARGUMENT (both data and a reference, negative offset
/// or size, range past the region's byte_size, offset not a multiple of
/// the dtype's size), FAILED_PRECONDITION (the object shrank before an
/// integer tensor could be read).
absl::StatusOr<ResolvedInputs> ResolveSharedInputs(const v1::ScoreRequest& req, ClientRegions& regions,
                                                   const std::string& owner);

}  // namespace logprob
