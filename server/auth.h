// Bearer-token authentication of the public LogprobService.
#pragma once

#include <array>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace logprob {

/// Checks that a call carries the metadata `authorization: Bearer <token>`
/// for one shared secret token. The token itself is never logged nor
/// returned in a status; the comparison is constant-time (SHA-256 digests
/// of the expected and the presented token compared with CRYPTO_memcmp, so
/// neither the content nor the length of the token leaks through timing).
class BearerTokenAuth {
 public:
  /// Reads the token from `path` (what `--auth-token-file` names), with
  /// leading and trailing whitespace (e.g. the final newline) removed.
  /// Errors (INVALID_ARGUMENT, the message names the file, never the
  /// token): the file cannot be read, is empty after trimming, or the token
  /// holds characters other than printable ASCII without spaces (it could
  /// not travel in a gRPC metadata value).
  static absl::StatusOr<BearerTokenAuth> FromFile(const std::string& path);

  /// A checker for `token` itself (tests; FromFile's rules apply).
  static absl::StatusOr<BearerTokenAuth> FromToken(const std::string& token);

  /// OK when one `authorization` metadata value of `context` is "Bearer "
  /// (scheme case-insensitive) followed by the token; otherwise
  /// UNAUTHENTICATED "missing or invalid bearer token".
  grpc::Status Check(const grpc::ServerContext& context) const;

 private:
  explicit BearerTokenAuth(const std::string& token);
  std::array<unsigned char, 32> digest_;  // SHA-256 of the token
};

}  // namespace logprob
