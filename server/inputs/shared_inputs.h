// Shared-memory inputs (Tensor.shared_memory): a reference to bytes of a
// region the client registered (server/inputs/client_regions.h), resolved into an
// InputSource that reads them with pread when they are needed.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"
#include "server/inputs/client_regions.h"
#include "server/inputs/input_source.h"

namespace logprob {

/// Bytes [offset, offset + byte_size) of a client's registered region,
/// read with ClientRegion::Read (never mapped: the client may shrink the
/// object at any time). A failed Read zero-fills and records the first
/// FAILED_PRECONDITION, which fails the request. Thread-safe.
std::shared_ptr<const InputSource> RegionSource(std::shared_ptr<const ClientRegion> region, int64_t offset,
                                                int64_t byte_size);

/// FAILED_PRECONDITION, reason SHARED_MEMORY_UNAVAILABLE: this server takes
/// no shared-memory references (--shared-memory-inputs=false); the client
/// sends bytes.
absl::Status SharedMemoryInputsOff();

/// The source of input `index` of a request, `tensor`, whose bytes are in
/// one of session `owner`'s regions (tensor.shared_memory). Errors name
/// the tensor: NOT_FOUND (region not registered by the session),
/// PERMISSION_DENIED (registered but not confirmed: nothing is read),
/// INVALID_ARGUMENT (negative offset or size, range past the region's
/// byte_size, offset not a multiple of the dtype's size).
absl::StatusOr<std::shared_ptr<const InputSource>> ResolveSharedMemory(const v1::Tensor& tensor, int index,
                                                                       ClientRegions& regions,
                                                                       const std::string& owner);

}  // namespace logprob
