// The checks of a BeginLmHeadUpdateRequest that need no open update: its
// fields (client_token, sha256), the head's shape and dtype, the new
// version's transform, the answer for a version name already taken, and
// the room a new version needs (the workers' memory, the store's files).
// LmHeadUpdates::Begin runs them in this order (server/heads/lm_head_updates.h).
#pragma once

#include <cstdint>
#include <future>
#include <string>

#include "absl/status/statusor.h"
#include "common/lm_head_source.h"
#include "logprob/v1/logprob.pb.h"
#include "server/heads/lm_head_store.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// The request's client_token (empty, or 16..128 characters of
/// [A-Za-z0-9_-]) and sha256 (empty, or 64 hex digits); returns the sha256
/// in lower case. INVALID_ARGUMENT naming the field.
absl::StatusOr<std::string> CheckBeginFields(const v1::BeginLmHeadUpdateRequest& req);

/// INVALID_ARGUMENT unless the request announces the head's [V, H] and
/// dtype (`cur`: the head's current version).
absl::Status CheckBeginShape(const v1::BeginLmHeadUpdateRequest& req, const LmHeadSource& cur);

/// The new version's transform: the head's (`cur`), with what `req` gives
/// instead. A bias in `req` is checked (shape [V], F32 / BF16 / F16, inline
/// bytes of that size, finite) and returned in *bias (else left empty).
/// INVALID_ARGUMENT naming the field.
absl::StatusOr<LmHeadTransform> UpdatedTransform(const v1::BeginLmHeadUpdateRequest& req, const LmHeadSource& cur,
                                                 v1::Tensor* bias);

/// The answer to a Begin of a version name the head took already (`taken`:
/// its sha256, waited for while it is computed): the same bytes (`sha`,
/// lower case) are already_committed; other or unstated bytes
/// ALREADY_EXISTS (a version name names one weight for the life of the head).
absl::StatusOr<v1::LmHeadUpdate> TakenVersionAnswer(const v1::BeginLmHeadUpdateRequest& req, const std::string& sha,
                                                    int64_t vocab_size, const std::shared_future<std::string>& taken);

/// RESOURCE_EXHAUSTED when another version of `head` (`per_worker` bytes
/// on each worker) would put the workers over `memory_bytes` (0: no cap),
/// or need a new store file beyond `store_files_per_head` (0: no cap; a
/// spare file is reused, not added).
absl::Status CheckVersionRoom(const LmHeads& heads, const LmHeadStore& store, const std::string& head,
                              int64_t per_worker, int64_t memory_bytes, int store_files_per_head);

}  // namespace logprob
