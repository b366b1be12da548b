// Where the bytes of a call's tensors come from: the message (inline or
// ScoreChunked pieces), a same-host client's registered shared memory, or
// its CUDA memory (IPC handles). One resolver, owned by the app, serves the
// scoring core and the lm_head update protocol alike, so a put's rows and a
// request's hidden states are offered and checked by the same rules.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"
#include "server/inputs/client_regions.h"
#include "server/inputs/cuda_ipc_inputs.h"
#include "server/inputs/input_source.h"
#include "server/inputs/request_inputs.h"

namespace logprob {

/// What the resolver offers (from the flags and the pool).
struct InputResolverOptions {
  /// Shared-memory inputs from same-host clients (RegisterSharedMemory,
  /// Tensor.shared_memory; --shared-memory-inputs): caps and idle expiry.
  bool shared_memory_inputs = true;
  ClientRegions::Options shared_memory_regions;
  /// CUDA IPC inputs (Tensor.cuda_ipc): the conditions of the flag, the
  /// backend and the pool (CudaIpcAvailabilityOf).
  CudaIpcAvailability cuda_ipc;
};

/// The caller of one call, as far as references need it.
struct InputCaller {
  /// The caller's shared-memory session (server/transport/shm_session.h),
  /// asked only when a tensor references shared memory. Empty: none.
  std::function<absl::StatusOr<std::string>()> session;
  /// The caller's address as gRPC writes it ("ipv4:127.0.0.1:5000"); "" when
  /// unknown (CUDA IPC inputs need a local peer).
  std::string peer;
};

/// Resolves tensors into byte sources and keeps the clients' shared-memory
/// regions. Thread-safe.
class InputResolver {
 public:
  explicit InputResolver(InputResolverOptions options);

  /// Every tensor of `req` (ResolveInputs' rules and errors).
  absl::StatusOr<RequestInputs> Resolve(const v1::ScoreRequest& req, const InputCaller& caller);

  /// One tensor that is not a ScoreRequest's (the rows of an lm_head
  /// update): inline bytes (viewed, not copied: `tensor` must outlive the
  /// source), shared memory, or a CUDA IPC reference offered under the same
  /// conditions as for scoring inputs (FAILED_PRECONDITION, reason
  /// CUDA_IPC_UNAVAILABLE, otherwise). `what` names the field in errors.
  absl::StatusOr<std::shared_ptr<const InputSource>> ResolveTensor(const v1::Tensor& tensor, const std::string& what,
                                                                   const InputCaller& caller);

  /// The ServerInfo fields of inputs: shared_memory_inputs and its caps,
  /// cuda_ipc_inputs, host_id.
  void Describe(v1::ServerInfo* info) const;

  /// Shared-memory regions of session `session` (ClientRegions' errors);
  /// FAILED_PRECONDITION when shared-memory inputs are off. A registered
  /// region is usable once confirmed (the proof of write access).
  absl::StatusOr<RegionChallenge> RegisterSharedMemory(const std::string& session, const std::string& name,
                                                       const std::string& shm_name, int64_t byte_size);
  absl::Status ConfirmSharedMemory(const std::string& session, const std::string& name);
  absl::StatusOr<int> UnregisterSharedMemory(const std::string& session, const std::string& name);
  absl::StatusOr<std::vector<ClientRegions::Listed>> ListSharedMemory(const std::string& session);
  /// OK when shared-memory inputs are on, else FAILED_PRECONDITION saying so.
  absl::Status SharedMemoryEnabled() const;

 private:
  InputContext Context(const InputCaller& caller) const;

  std::unique_ptr<ClientRegions> regions_;  // null: shared-memory inputs off
  const CudaIpcAvailability cuda_ipc_;
  std::string host_id_;
};

}  // namespace logprob
