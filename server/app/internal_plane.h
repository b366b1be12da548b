// How the front-end secures its internal plane (the control service and
// the calls to its workers): the pool secret it uses, chosen from the
// flags (docs/security.md "The internal plane").
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/internal_auth.h"
#include "common/pool_secret.h"

namespace logprob {

/// The front-end's choice for its internal plane.
struct InternalPlane {
  /// The pool secret (absent only for an insecure plane).
  std::optional<PoolSecret> secret;
  /// What the control service checks and the worker channels send.
  InternalAuth auth = InternalAuth::Insecure();
  /// One line for the start-up log saying how the plane is secured.
  std::string description;
};

/// Chooses the plane from the flags: `secret_file` (--internal-secret-file:
/// the secret front-end and workers share), `insecure`
/// (--insecure-internal-plane), `cluster` (--external-workers: workers
/// started elsewhere) and `control_listen` (--control-listen).
///  - a secret file: its secret (PoolSecret::FromFile's errors);
///  - else, local workers: a fresh secret (PoolSecret::Generate), which the
///    front-end hands to the workers it spawns through a descriptor;
///  - else, cluster mode: insecure only with `insecure`, or on a loopback
///    --control-listen (only this host's processes reach it; logged as
///    unauthenticated); a cluster plane beyond loopback without either
///    is INVALID_ARGUMENT, naming both flags.
/// `secret_file` with `insecure` is INVALID_ARGUMENT. Pure but for
/// reading the file.
absl::StatusOr<InternalPlane> ChooseInternalPlane(const std::string& secret_file, bool insecure, bool cluster,
                                                  const std::string& control_listen);

}  // namespace logprob
