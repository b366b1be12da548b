// How a replicated logprob-server asks its peers for their lm_head
// versions at start (--lm-head-sync-from; server/transport/lm_head_peer_sync.h).
#pragma once

#include "server/app/server_flags.h"
#include "server/transport/lm_head_peer_sync.h"

namespace logprob {

/// The peer sync of checked flags: --lm-head-sync-from as the target,
/// channels with the --auth-token-file token and, with
/// --lm-head-sync-tls-ca, TLS (the --tls-cert / --tls-key pair as client
/// certificate, --lm-head-sync-tls-server-name as the name to verify), and
/// --lm-head-sync-timeout per version read.
PeerSyncOptions PeerSyncOptionsFromFlags(const ServerFlags& flags);

}  // namespace logprob
