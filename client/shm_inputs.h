// Client side of shared-memory inputs (logprob.v1 RegisterSharedMemory):
// a same-host client writes a request's tensors into a POSIX shared-memory
// region it registered and sends (region, offset, byte_size) references
// instead of the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/shared_memory.h"
#include "grpcpp/client_context.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob::client {

/// One reusable, registered region of this process and its session.
/// Not thread-safe for Place; Attach may be called from any thread while
/// no Place runs (e.g. a bench sending one placed request from many threads).
class ShmInputs {
 public:
  /// Starts a session (a random `logprob-shm-session` key) on `stub`'s
  /// server. No region yet: Place makes one. `timeout_seconds` bounds each
  /// registration call (60 s when <= 0).
  ShmInputs(v1::LogprobService::StubInterface& stub, double timeout_seconds);
  /// Unregisters the region (best effort) and removes it.
  ~ShmInputs();
  ShmInputs(const ShmInputs&) = delete;
  ShmInputs& operator=(const ShmInputs&) = delete;

  /// Moves the bytes of every input tensor of `request` into the region
  /// (one memcpy each, 64-byte aligned, one after another) and replaces
  /// them by references. A region too small is replaced by a registered one
  /// of the next power of two >= max(bytes, 1 MiB) (pages reserved and
  /// pre-faulted). Errors: the registration's status (e.g.
  /// FAILED_PRECONDITION when the server has shared-memory inputs off,
  /// NOT_FOUND when it cannot see this host's /dev/shm), or the system
  /// error making the region (RESOURCE_EXHAUSTED when /dev/shm is full).
  absl::Status Place(v1::ScoreRequest* request);
  /// Adds the session metadata to a call's context (every call whose
  /// request Place filled needs it).
  void Attach(grpc::ClientContext* context) const;

  const std::string& session() const { return session_; }
  size_t capacity() const { return size_; }

 private:
  absl::Status Grow(size_t bytes);
  void Release();  // unregister, unmap, unlink

  v1::LogprobService::StubInterface& stub_;
  double timeout_seconds_;
  std::string session_;
  std::string region_;                 // registered name ("" when none)
  std::unique_ptr<SharedRegion> shm_;  // "/logprob-client-<pid>-<random>", or null
  size_t size_ = 0;
};

/// True when the server's ServerInfo says it takes shared-memory inputs
/// and its host_id equals this process's (SharedMemoryHostId).
bool SameSharedMemoryHost(const v1::ServerInfo& info);

}  // namespace logprob::client
