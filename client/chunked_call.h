// The client side of ScoreChunked: one request of any size as a stream of
// pieces of a few MB (large single gRPC messages move far slower than
// small ones; README "Large requests").
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/chunk_codec.h"
#include "grpcpp/channel.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob::client {

/// When and how requests travel in pieces (flags --chunk-above,
/// --piece-bytes of `score`).
struct ChunkOptions {
  /// Requests of more serialized bytes than this use ScoreChunked; < 0:
  /// never (always one Score message).
  int64_t above_bytes = int64_t{8} << 20;
  /// Data bytes per piece, >= 1.
  int64_t piece_bytes = chunked::kDefaultPieceBytes;
};

/// True when `request` (of `request_bytes` serialized bytes) goes chunked.
inline bool UseChunked(const ChunkOptions& o, int64_t request_bytes) {
  return o.above_bytes >= 0 && request_bytes > o.above_bytes;
}

/// Input tensors up to this size travel inside the first part.
inline constexpr int64_t kInlineBytes = chunked::kDefaultInlineBytes;

/// Sends `request` through ScoreChunked on `channel`: first the request
/// without the data of its tensors over `inline_bytes`, then those tensors' bytes
/// in pieces of `piece_bytes` that view `request`'s memory (no copies in
/// this process), then half-closes; assembles the answer (pieces of large
/// outputs are copied once into their tensors). `timeout_seconds` > 0 sets
/// the call's deadline. Errors: the call's status (gRPC code and
/// message); INTERNAL for an answer that is not a valid chunked response.
absl::StatusOr<v1::ScoreResponse> ScoreChunked(const std::shared_ptr<grpc::Channel>& channel,
                                               const v1::ScoreRequest& request, int64_t piece_bytes,
                                               double timeout_seconds, int64_t inline_bytes = kInlineBytes);

/// The same for a request whose large tensors' bytes live elsewhere (e.g.
/// a mapped file, MappedSafetensors): `header` is the request with the data
/// of tensors `pieced` (indices, ascending) empty, `data[k]` the bytes of
/// tensor pieced[k] (viewed, not copied; valid until this returns).
absl::StatusOr<v1::ScoreResponse> ScoreChunkedViews(const std::shared_ptr<grpc::Channel>& channel,
                                                    const v1::ScoreRequest& header, const std::vector<int>& pieced,
                                                    const std::vector<std::string_view>& data, int64_t piece_bytes,
                                                    double timeout_seconds);

}  // namespace logprob::client
