// The pool secret: a per-start random value that every call of the
// internal plane (the front-end's Control service, each worker's Worker
// service) must carry (common/internal_auth.h). The front-end makes one
// at start for the workers it spawns and hands it to them through an
// inherited descriptor (never argv or the environment); a cluster (a
// Kubernetes Secret, the Ray launcher) gives front-end and workers the
// same file (--internal-secret-file). docs/security.md "The internal
// plane".
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace logprob {

/// A pool secret: printable ASCII without spaces, 16 to 4096 characters.
/// Immutable; thread-safe. Its value is never logged nor put in a status.
class PoolSecret {
 public:
  /// 32 bytes of getrandom(2), as 64 hex digits. Aborts the process if the
  /// kernel has no randomness to give (it never happens after boot).
  static PoolSecret Generate();

  /// Reads the secret from `path` (what --internal-secret-file names),
  /// leading and trailing whitespace removed. INVALID_ARGUMENT (the message
  /// names the file, never its contents) when it cannot be read, is
  /// readable by other users (mode o+r: chmod 600, or a Kubernetes
  /// Secret's defaultMode 0400), is not a regular file, or holds fewer
  /// than 16 or more than 4096 characters, or characters other than
  /// printable ASCII without spaces.
  static absl::StatusOr<PoolSecret> FromFile(const std::string& path);

  /// Reads the secret from descriptor `fd` (from offset 0, as a memfd made
  /// by ToInheritableFd), with FromFile's rules; the descriptor stays open.
  static absl::StatusOr<PoolSecret> FromFd(int fd);

  /// A sealed memfd holding the secret, close-on-exec (the launcher dup2s
  /// it into a child, which clears the flag on the copy). The caller owns
  /// the descriptor. INTERNAL when memfd_create or the write fails.
  absl::StatusOr<int> ToInheritableFd() const;

  const std::string& value() const { return value_; }

 private:
  explicit PoolSecret(std::string value) : value_(std::move(value)) {}
  /// `text` trimmed and checked (FromFile's rules); `where` names its origin.
  static absl::StatusOr<PoolSecret> Parse(const std::string& text, const std::string& where);
  std::string value_;
};

}  // namespace logprob
