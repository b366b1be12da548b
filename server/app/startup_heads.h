// The lm_heads logprob-server serves from its start: the --lm-head files
// (resolved, hashed and logged), the --lm-head-declare shapes, and the
// store folder updated versions are written to.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/lm_head_precision.h"
#include "common/lm_head_source.h"
#include "server/app/server_flags.h"
#include "server/heads/lm_heads.h"
#include "server/heads/store_folder.h"

namespace logprob {

/// The head name and path of an --lm-head [NAME=]PATH[:TENSOR] value: NAME=
/// when what precedes '=' is a name and the whole is not a path (else the
/// name is kDefaultLmHead).
std::pair<std::string, std::string> SplitLmHeadArg(const std::string& arg);

/// The lm_head store's part of the memory bound (LmHeadStoreBytes of every
/// --lm-head updates may change: not --lm-head-frozen, from the heads'
/// headers; and of every --lm-head-declare, from its shape); 0 without
/// --allow-lm-head-updates. Reads only the files' headers.
absl::StatusOr<int64_t> LmHeadStoreBound(const ServerFlags& flags);

/// A start-up head from "[NAME=]PATH[:TENSOR]" at `version`: its source,
/// its bytes per worker (of `workers`) and the SHA-256 of its weight bytes
/// (read once here); logged in one line.
absl::StatusOr<LmHeadVersion> LoadStartupHead(const std::string& arg, const std::string& version, int workers,
                                              const LmHeadScalarFlags& scalars, LmHeadPrecision precision, bool device);

/// Adds the heads of checked flags to `heads`: each --lm-head
/// (LoadStartupHead), then each --lm-head-declare; then checks that every
/// --lm-head-frozen names a head. The first error, with the message to print.
absl::Status AddStartupHeads(const ServerFlags& flags, LmHeads& heads);

/// The lm_head store's folder of this process start (server/heads/store_folder.h)
/// under `root_flag` (--lm-head-store-dir), or by default under /dev/shm
/// (memory: no disk writeback on the update path), else under $TMPDIR (the
/// reason logged). Stale folders of exited front-ends under the root are
/// removed first.
absl::StatusOr<std::unique_ptr<StoreFolder>> MakeStoreFolder(const std::string& root_flag);

}  // namespace logprob
