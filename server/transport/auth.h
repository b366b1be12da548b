// Bearer-token authentication of the public LogprobService, and the two
// rights a token may carry (scoring, lm_head updates).
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

  /// True when one `authorization` value of `context` carries the token
  /// (Check's rule, without a status).
  bool PresentedBy(const grpc::ServerContext& context) const;

  /// True when `other` checks the same token (constant-time).
  bool SameTokenAs(const BearerTokenAuth& other) const;

 private:
  explicit BearerTokenAuth(const std::string& token);
  std::array<unsigned char, 32> digest_;  // SHA-256 of the token
};

/// A right a LogprobService call needs.
enum class Right {
  kScore,   // scoring, GetServerInfo, shared-memory regions
  kUpdate,  // BeginLmHeadUpdate, PutLmHeadRows, CommitLmHeadUpdate, AbortLmHeadUpdate
};

/// Which bearer token grants which right (docs/security.md "Separate
/// rights"), from the server's --auth-token-file (`scoring`) and
/// --update-token-file (`update`); either may be null (not set):
///  - kScore: open without a scoring token; else the scoring token or the
///    update token (an updater may also score).
///  - kUpdate: the update token when one is set (the scoring token is
///    refused); else the scoring token when set (one token, both rights);
///    else open.
/// Thread-safe (immutable); the tokens are not owned and outlive it.
class AccessPolicy {
 public:
  AccessPolicy(const BearerTokenAuth* scoring, const BearerTokenAuth* update) : scoring_(scoring), update_(update) {}

  /// OK when `context` may call `method` (its name, for the message), which
  /// needs `right`. Otherwise UNAUTHENTICATED "missing or invalid bearer
  /// token" (no token of the right's, nor any known one), or
  /// PERMISSION_DENIED naming `method` and the missing update right when
  /// the call carries the scoring token only. Never echoes a token.
  grpc::Status Check(const grpc::ServerContext& context, Right right, const char* method) const;

  /// True when no token is needed for any right.
  bool open() const { return scoring_ == nullptr && update_ == nullptr; }

 private:
  const BearerTokenAuth* scoring_;
  const BearerTokenAuth* update_;
};

}  // namespace logprob
