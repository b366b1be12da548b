// Splitting one ScoreRequest that is too large for the server into several
// smaller ones by whole sequences, and joining their responses back into
// the response of the original request.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob::client {

/// What each part of a split request must respect.
struct SplitLimits {
  /// Largest serialized ScoreRequest (ByteSizeLong) of a part; must be > 0.
  int64_t max_bytes = 0;
  /// Largest number of token positions (rows of `logits`/`hidden_states`:
  /// b*S padded, t packed) of a part; 0 means no limit.
  int64_t max_tokens = 0;
};

/// Splits `request` into consecutive parts that each fit `limits` and
/// together hold the original sequences in order, so that joining the
/// parts' responses with JoinScoreResponses gives the original's response.
///
/// - Already fitting: returns {request} unchanged (same id).
/// - Padded input (`logits`/`hidden_states` [B,S,X]): every input
///   (`input_ids` [B,S], `seq_lens` [B], `gather_indices` [B,S',K], ...) is
///   cut along B into contiguous groups of sequences.
/// - Packed input (`logits`/`hidden_states` [T,X], `input_ids` [T],
///   `cu_seqlens` [B+1], optional `gather_indices` [T-B or T, K]): cut by
///   whole sequences; each part's `cu_seqlens` is rebased to start at 0
///   and keeps its dtype; `gather_indices` rows follow the output rows
///   (L-1 per sequence of length L for next_token alignment, L for
///   same_position). Without `cu_seqlens` the T rows are one sequence.
/// - Parts are filled greedily and get ids "<request.id>-<i>", i = 1..n,
///   and the request's options, head and head_version.
///
/// Errors: INVALID_ARGUMENT when a single sequence alone does not fit
/// (naming the sequence and its size), or when the inputs are not
/// consistent enough to cut (shapes, dtypes, byte counts, cu_seqlens
/// values, unexpected tensors).
absl::StatusOr<std::vector<v1::ScoreRequest>> SplitScoreRequest(const v1::ScoreRequest& request,
                                                                const SplitLimits& limits);

/// Joins the responses of the parts made by SplitScoreRequest, given in
/// part order, into one response with id `id`: each output tensor is the
/// concatenation of the parts' tensors of that name along the first
/// dimension (B for padded, the token dimension for packed output), with
/// the first part's head and head_version. A single part is returned as is
/// (with id `id`).
/// Errors: INVALID_ARGUMENT when there are no parts or the parts disagree
/// on output names, dtypes or trailing dimensions, or a tensor's bytes do
/// not match its shape; a part with a non-zero status_code gives that
/// code and message.
absl::StatusOr<v1::ScoreResponse> JoinScoreResponses(std::vector<v1::ScoreResponse> parts, const std::string& id);

}  // namespace logprob::client
