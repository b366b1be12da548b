// Who owns shared-memory regions: the session key of a call.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/shared_memory.h"  // kShmSessionMetadata
#include "grpcpp/server_context.h"

namespace logprob {

/// Metadata key carrying a client's shared-memory session key.

/// The owner key of `context`'s shared-memory regions (ClientRegions).
/// gRPC C++ gives a server no per-connection hook, so a session is what
/// the client names: the `logprob-shm-session` metadata value (16..128 of
/// [A-Za-z0-9_-]; clients pick 128 random bits), bound to the peer's host
/// and, when the call carries one, to its `authorization` value: the key
/// is the hex SHA-256 of the three. Another client must know the session
/// key, call from the same host and hold the same token to use a region.
/// Errors: INVALID_ARGUMENT (no or malformed session key),
/// PERMISSION_DENIED (the peer is not on this host: not loopback nor a
/// Unix socket; its shm names would name this host's objects).
absl::StatusOr<std::string> SharedMemoryOwner(const grpc::ServerContext& context);

}  // namespace logprob
