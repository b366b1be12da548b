// Wire codec of ScoreChunked parts (proto/logprob/v1/logprob.proto,
// ScoreRequestPart / ScoreResponsePart) that moves tensor bytes without
// protobuf copies: a piece is sent as a small header slice plus a slice
// viewing the caller's bytes, and a received piece is copied once, straight
// from gRPC's receive slices into its destination.
//
// Both message types share one layout: field 1 = the message (ScoreRequest
// or ScoreResponse), field 2 = TensorPiece {1: tensor, 2: offset, 3: data}.
// tests/data/chunk_codec holds the golden parts (and the rules) that this
// codec and the Python client's (client/python/logprob_client/_internal/transport.py)
// are both tested against.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/impl/serialization_traits.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "grpcpp/support/status.h"

namespace logprob::chunked {

/// Default size of a piece's data: large enough that per-message costs
/// vanish, small enough that no buffer of gRPC or protobuf crosses glibc's
/// 32 MiB mmap threshold (see README "Large requests"), and that a piece a
/// client copies before gRPC copies it again (the Python client) is still
/// in the core's cache: in interleaved rounds on the 2-core VM, Python's
/// pieced lm_head updates took 1.27x as long in 4 MiB pieces, and the C++
/// client's echo-chunked phase moved 0-17% fewer bytes per second
/// (docs/benchmarks.md, "Piece size").
inline constexpr int64_t kDefaultPieceBytes = int64_t{2} << 20;

/// Tensors up to this size travel inside the first part instead of in
/// pieces (ServerInfo.chunked_inline_bytes; the clients' default too).
inline constexpr int64_t kDefaultInlineBytes = int64_t{64} << 10;

/// A part to send. Either `message` (a ScoreRequestPart or
/// ScoreResponsePart, serialized as is; not owned), or a piece: bytes
/// [offset, offset + bytes.size()) of tensor `tensor`. `bytes` is not
/// copied: it must stay valid until the call ends.
struct OutgoingPart {
  const google::protobuf::MessageLite* message = nullptr;
  int32_t tensor = 0;
  int64_t offset = 0;
  std::string_view bytes;
};

/// A received part, not yet parsed (ParsePart).
struct IncomingPart {
  grpc::ByteBuffer buffer;
};

/// A parsed part. For a message, `message` holds the serialized bytes of
/// field 1; for a piece, tensor / offset / size are set and CopyData
/// copies the data.
class ParsedPart {
 public:
  bool is_piece() const { return is_piece_; }
  const std::string& message() const { return message_; }
  int32_t tensor() const { return tensor_; }
  int64_t offset() const { return offset_; }
  int64_t size() const { return size_; }
  /// Copies the piece's `size()` bytes to `dst`.
  void CopyData(char* dst) const;

 private:
  friend absl::StatusOr<ParsedPart> ParsePart(const IncomingPart& part);
  bool is_piece_ = false;
  std::string message_;
  int32_t tensor_ = 0;
  int64_t offset_ = 0;
  int64_t size_ = 0;
  std::vector<grpc::Slice> slices_;  // the part's bytes (references)
  size_t data_slice_ = 0, data_pos_ = 0;
};

/// Parses a received part. INVALID_ARGUMENT ("malformed chunked part: ...")
/// when the bytes are not a ScoreRequestPart / ScoreResponsePart holding
/// exactly one message or one piece, by the rules of
/// tests/data/chunk_codec/README.md, which Python's transport.parse_part
/// shares: truncated or overlong varints, fields running past the part or
/// the piece, a known field of the wrong wire type, a duplicate field,
/// a negative tensor or offset, a tensor above 2^31 - 1. Unknown fields
/// are skipped.
absl::StatusOr<ParsedPart> ParsePart(const IncomingPart& part);

/// The serialized header of a piece part (everything before its data):
/// field 2 tag and length, then tensor, offset and the data's tag and
/// length. Exposed for tests and other writers of the same bytes.
std::string PieceHeader(int32_t tensor, int64_t offset, uint64_t size);

}  // namespace logprob::chunked

namespace grpc {

/// gRPC serialization of OutgoingPart (write-only).
template <>
class SerializationTraits<logprob::chunked::OutgoingPart, void> {
 public:
  static Status Serialize(const logprob::chunked::OutgoingPart& part, ByteBuffer* buffer, bool* own_buffer);
  static Status Deserialize(ByteBuffer*, logprob::chunked::OutgoingPart*) {
    return Status(StatusCode::INTERNAL, "OutgoingPart is write-only");
  }
};

/// gRPC deserialization of IncomingPart: takes the buffer as is.
template <>
class SerializationTraits<logprob::chunked::IncomingPart, void> {
 public:
  static Status Serialize(const logprob::chunked::IncomingPart& part, ByteBuffer* buffer, bool* own_buffer) {
    *buffer = part.buffer;
    *own_buffer = true;
    return Status::OK;
  }
  static Status Deserialize(ByteBuffer* buffer, logprob::chunked::IncomingPart* part) {
    part->buffer.Swap(buffer);
    buffer->Clear();
    return Status::OK;
  }
};

}  // namespace grpc
