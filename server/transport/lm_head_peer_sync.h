// Catching up with the other front-ends of a replicated deployment
// (logprob-server --lm-head-sync-from): before a front-end serves its
// heads, it asks its peers which version of each head is current and pulls
// the newest one it lacks through ReadLmHeadRows, committing it through its
// own update path, so a replica that starts later never scores a head's
// start-up weights under a name its peers have updated.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "logprob/v1/logprob.pb.h"
#include "server/heads/lm_head_updates.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// The addresses behind a --lm-head-sync-from target, each dialable alone
/// (common/replica_target.h: the grammar the Python replicas share):
/// "ipv4:" / "ipv6:" lists as given; every other HOST (under "dns:",
/// "dns:///" or plain) resolved to each of its A/AAAA records
/// (getaddrinfo). A name that does not resolve (no peers yet: a headless
/// Service lists only ready pods) gives no address, not an error.
/// ParseReplicaTarget's INVALID_ARGUMENT. Duplicates removed, order kept.
/// Blocking (DNS); thread-safe.
absl::StatusOr<std::vector<std::string>> ResolvePeerTarget(const std::string& target);

/// Where and how to ask the peers.
struct PeerSyncOptions {
  std::string target;  // --lm-head-sync-from
  /// A channel to one peer address (TLS and the bearer token as the
  /// deployment needs: client::MakeChannel in logprob-server).
  std::function<absl::StatusOr<std::shared_ptr<grpc::Channel>>(const std::string& address)> channel;
  std::chrono::seconds info_timeout{10};   // each peer's GetServerInfo
  std::chrono::seconds pull_timeout{600};  // each version's ReadLmHeadRows
};

/// One head pulled (or found current already), for logs and tests.
struct PeerSyncResult {
  std::string head, version, peer;  // peer: the address it came from ("" when nothing was pulled)
  bool pulled = false;
};

/// Rounds SyncLmHeadsFromPeers asks the peers at most.
inline constexpr int kPeerSyncRounds = 3;

/// For each head of `heads` that is not frozen and still at its start-up
/// version (or one this call pulled: a client's update that reached this
/// server meanwhile is newer than any peer's): the peers' current
/// versions that an update committed (committed_unix_ms > 0); the newest
/// of them (largest committed_unix_ms; ties: the one most peers hold) is
/// pulled unless this server took that name with the same sha256 already:
/// read with ReadLmHeadRows from a peer holding it (the next such peer on
/// failure) and fed to `updates` by the update driver
/// (DriveLmHeadUpdate over InProcessLmHeadUpdateCalls: Begin with its
/// sha256, logit transform and bias; one put of the streamed rows straight
/// into the staged file; Commit, which checks the sha256). Peers that do not
/// answer are logged and skipped; no peer answering is no error (the first
/// replica of a deployment). Errors: the target's (ResolvePeerTarget);
/// FAILED_PRECONDITION when a peer's head has another shape or dtype than
/// this server's, or the name is taken here with other bytes; the last
/// pull's error when no peer could give a version. Asks again (up to
/// kPeerSyncRounds rounds) while a round pulled something, so an update
/// the peers committed meanwhile is caught; returns the last round's
/// results. Blocking; call it once, before the heads are served.
absl::StatusOr<std::vector<PeerSyncResult>> SyncLmHeadsFromPeers(const PeerSyncOptions& options, const LmHeads& heads,
                                                                 LmHeadUpdates& updates);

}  // namespace logprob
