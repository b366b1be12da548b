// Reading a committed lm_head version back out of a front-end
// (ReadLmHeadRows): what a replica that starts later pulls from a peer to
// catch up (server/transport/lm_head_peer_sync.h). Transport-free: the caller writes
// each part where it goes.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "logprob/v1/logprob.pb.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// Streams rows [row_begin, row_end) (row_end 0: V) of version `version`
/// (empty: the current one) of head `head` from `heads`: first a part
/// carrying LmHeadVersionRows (the version's LmHeadInfo with its SHA-256,
/// waited for when still computing; the rows; the bias [V] inline as F32
/// when the head has one), then the rows' bytes (row-major, the version's
/// dtype) in TensorPiece parts of at most `piece_bytes`, in order of
/// offset, read from the version's file (the store file of an update, the
/// start-up checkpoint otherwise) with positioned reads. The version stays
/// bound (its file alive) until the last part is written. `write` returns
/// false when the caller went away: CANCELLED then. Errors: LmHeads::Bind's
/// (NOT_FOUND unknown head, FAILED_PRECONDITION a version not retained),
/// INVALID_ARGUMENT for a bad name or a row range outside [0, V],
/// DATA_LOSS when the file cannot be read (or its SHA-256 could not be
/// computed). Thread-safe; memory: one piece.
absl::Status ReadLmHeadVersion(const LmHeads& heads, const v1::ReadLmHeadRowsRequest& req, int64_t piece_bytes,
                               const std::function<bool(const v1::LmHeadRowsChunk&)>& write);

}  // namespace logprob
