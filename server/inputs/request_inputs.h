// One step from a request's tensors to their byte sources: inline bytes
// (or bytes assembled from ScoreChunked pieces), shared-memory references,
// CUDA IPC handles. Everything after it reads bytes through InputSource.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"
#include "server/inputs/client_regions.h"
#include "server/inputs/cuda_ipc_inputs.h"
#include "server/inputs/input_source.h"

namespace logprob {

/// What the caller offers for resolving references.
struct InputContext {
  /// Registered shared-memory regions; null: shared-memory inputs are off.
  ClientRegions* regions = nullptr;
  /// The caller's shared-memory session (server/transport/shm_session.h), asked only
  /// when a tensor references shared memory; empty: the call has none.
  std::function<absl::StatusOr<std::string>()> session;
  /// Whether CUDA IPC inputs can be served, and the caller's address.
  CudaIpcAvailability cuda_ipc;
  std::string peer;
};

/// A request's tensors resolved: sources[i] holds inputs[i]'s bytes.
struct RequestInputs {
  std::vector<std::shared_ptr<const InputSource>> sources;
  /// Bytes referenced rather than carried in the message.
  int64_t referenced_bytes = 0;
  /// Keeps the shared-memory session from expiring while the request runs.
  std::shared_ptr<void> session_hold;
};

/// Every tensor of `req` as a source. Errors (naming the tensor):
/// FAILED_PRECONDITION when a kind is off on this server or the request's
/// options need what its kind cannot do (RulesOf: sampling filters on a
/// CUDA IPC input); INVALID_ARGUMENT for a kind on a tensor it does not
/// serve; ResolveSharedMemory's and ResolveCudaIpc's errors.
absl::StatusOr<RequestInputs> ResolveInputs(const v1::ScoreRequest& req, const InputContext& context);

/// Sources viewing each tensor's `data` (what ResolveInputs gives a
/// request without references).
RequestInputs InlineInputs(const v1::ScoreRequest& req);

}  // namespace logprob
