// The lm_head update protocol (server/heads/lm_head_updates.h) wired to
// logprob-server's worker pool, metrics and flags.
#pragma once

#include <string>

#include "server/app/server_flags.h"
#include "server/heads/lm_head_updates.h"
#include "server/heads/lm_heads.h"
#include "server/metrics/metrics.h"
#include "server/pool/worker_pool.h"

namespace logprob {

/// The update options of checked flags, versions staged under `store_dir`
/// (the store folder's path).
LmHeadUpdates::Options LmHeadUpdateOptionsFromFlags(const ServerFlags& flags, const std::string& store_dir);

/// The workers' side of an update, through `pool` (outlives the result):
/// load, serving check, drop and staging of rows sent as a CUDA IPC
/// handle (copied by a worker on this host).
LmHeadWorkers LmHeadWorkersOf(WorkerPool& pool);

/// Sets each head's metrics series (name, version, bytes held per worker);
/// a declared head gets its series with its first version.
void PublishLmHeads(Metrics& metrics, const LmHeads& heads);

/// Update outcomes, bytes and the store's size into `metrics`; a commit
/// republishes the heads (PublishLmHeads). Both outlive the result.
LmHeadUpdateObservers LmHeadUpdateObserversOf(Metrics& metrics, const LmHeads& heads);

}  // namespace logprob
