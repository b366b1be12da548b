// Authentication of the internal plane: every call of the front-end's
// Control service and of each worker's Worker service carries the pool
// secret (common/pool_secret.h) as the metadata kPoolSecretMetadataKey,
// and each handler checks it before anything else runs. Both sides use
// this class: the services to check, the channels to send.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>

#include "common/pool_secret.h"
#include "grpcpp/channel.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"

namespace logprob {

/// gRPC metadata key of the pool secret on every internal call.
inline constexpr char kPoolSecretMetadataKey[] = "logprob-pool-secret";

/// Who may call the internal plane: holders of one pool secret, or, only
/// when a deployment says so (--insecure-internal-plane), anyone.
/// Immutable; thread-safe; cheap to copy.
class InternalAuth {
 public:
  /// Calls must carry `secret`.
  explicit InternalAuth(const PoolSecret& secret);
  /// No check and nothing sent: an unauthenticated plane (the operator's
  /// --insecure-internal-plane, or a unit test calling handlers directly).
  static InternalAuth Insecure() { return InternalAuth(); }

  /// OK when the call carries the secret (one kPoolSecretMetadataKey value
  /// equal to it, compared in constant time over SHA-256 digests), or the
  /// plane is insecure. Otherwise UNAUTHENTICATED naming `method` and what
  /// to do, never the secret. Counts refusals (refused()) and logs the
  /// first and then every 1000th with the caller's address.
  grpc::Status Check(const grpc::ServerContext& context, const char* method) const;

  /// A channel to `target` (insecure transport) whose every call carries
  /// the secret; a plain channel when insecure.
  std::shared_ptr<grpc::Channel> Channel(const std::string& target, const grpc::ChannelArguments& args) const;

  bool insecure() const { return !secret_.has_value(); }
  /// Calls refused by Check so far, by every InternalAuth of the process.
  static int64_t refused();

 private:
  InternalAuth() = default;
  std::optional<std::string> secret_;       // what the channels send
  std::array<unsigned char, 32> digest_{};  // SHA-256 of secret_
};

}  // namespace logprob
