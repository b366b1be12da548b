#include "server/app/internal_plane.h"

#include "absl/strings/str_cat.h"
#include "common/loopback.h"

namespace logprob {

absl::StatusOr<InternalPlane> ChooseInternalPlane(const std::string& secret_file, bool insecure, bool cluster,
                                                  const std::string& control_listen) {
  InternalPlane plane;
  if (!secret_file.empty() && insecure)
    return absl::InvalidArgumentError("--internal-secret-file and --insecure-internal-plane are mutually exclusive");
  if (!secret_file.empty()) {
    absl::StatusOr<PoolSecret> secret = PoolSecret::FromFile(secret_file);
    if (!secret.ok()) return secret.status();
    plane.secret = *std::move(secret);
    plane.description = "internal plane authenticated by the pool secret of --internal-secret-file";
  } else if (insecure) {
    plane.description =
        "WARNING: --insecure-internal-plane: the control and worker ports take calls from anyone who reaches them "
        "(they can join the pool, read the lm_heads and the work items); keep them on a network only the pool "
        "reaches";
  } else if (!cluster) {
    plane.secret = PoolSecret::Generate();
    plane.description =
        "internal plane authenticated by a pool secret made at start (handed to the local workers "
        "through a descriptor)";
  } else if (IsLoopbackHost(control_listen.substr(0, control_listen.rfind(':')))) {
    plane.description = absl::StrCat(
        "WARNING: cluster mode without --internal-secret-file: the internal plane is unauthenticated; "
        "--control-listen ",
        control_listen, " is loopback, so only this host's processes reach it, any local user included");
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--external-workers with --control-listen ", control_listen,
        " (beyond loopback) needs --internal-secret-file (a file holding the pool secret, e.g. `openssl rand -hex 32`, "
        "given to the workers too) so that nobody else can join the pool; --insecure-internal-plane runs it "
        "unauthenticated"));
  }
  if (plane.secret) plane.auth = InternalAuth(*plane.secret);
  return plane;
}

}  // namespace logprob
