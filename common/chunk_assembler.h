// Receiving side of ScoreChunked: checks each piece of a chunked message as
// it arrives and writes its bytes, once, into the buffer of its tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/chunk_codec.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob::chunked {

/// Assembles the tensors of one chunked message (a ScoreRequest's inputs
/// or a ScoreResponse's outputs, from the first part). A tensor whose data
/// is empty although its shape has elements is "pending": its
/// product(shape) * sizeof(dtype) bytes come in pieces, each starting at
/// the offset where the previous one ended. Not thread-safe.
class TensorAssembler {
 public:
  /// A buffer of exactly `bytes` bytes (its contents are overwritten).
  using Allocate = std::function<std::string(size_t bytes)>;

  /// Plans the assembly of `tensors` (not owned; must outlive this).
  /// `what` names the field in messages ("inputs", "outputs").
  /// INVALID_ARGUMENT naming the tensor for a pending tensor with an
  /// unspecified dtype, a negative dimension or a size over 2^62 bytes.
  static absl::StatusOr<TensorAssembler> Plan(google::protobuf::RepeatedPtrField<v1::Tensor>* tensors,
                                              const char* what);

  /// Bytes the pieces will carry in all (the pending tensors' sizes).
  int64_t pending_bytes() const { return pending_bytes_; }
  /// Indices of the pending tensors.
  std::vector<int> pending() const;

  /// Takes each pending tensor's buffer from `allocate`. Call once,
  /// before Add.
  void AllocateBuffers(const Allocate& allocate);
  /// Has every pending tensor's bytes written to `dst` (its announced
  /// size, the caller's memory: an lm_head update's staged file) instead
  /// of a buffer; Finish then leaves the tensors' data empty. One pending
  /// tensor expected (INVALID_ARGUMENT otherwise). Call once, before Add,
  /// instead of AllocateBuffers.
  absl::Status AssembleInto(char* dst);

  /// Checks `piece` (a known, pending tensor; offset = the bytes of that
  /// tensor received so far; not past its size) and copies its bytes.
  /// INVALID_ARGUMENT naming the tensor and offset otherwise.
  absl::Status Add(const ParsedPart& piece);

  /// True once every pending tensor has all its bytes.
  bool complete() const { return received_bytes_ == pending_bytes_; }
  /// Bytes of pieces added so far (each tensor's come in order).
  int64_t received_bytes() const { return received_bytes_; }

  /// Moves the buffers into the tensors' data. INVALID_ARGUMENT naming the
  /// first incomplete tensor and its offset when bytes are missing.
  absl::Status Finish();

  /// Where the assembly stands, for error messages: the first incomplete
  /// tensor ("tensor 0 \"logits\" at byte 4194304 of 67108864"), or
  /// "all N bytes received".
  std::string Position() const;

 private:
  struct Slot {
    int64_t size = 0;      // announced bytes; -1 when not pending
    int64_t received = 0;  // bytes so far
    std::string buffer;
    char* dst = nullptr;  // AssembleInto's memory, else null (buffer)
  };
  TensorAssembler(google::protobuf::RepeatedPtrField<v1::Tensor>* tensors, const char* what)
      : tensors_(tensors), what_(what) {}
  std::string Name(int i) const;

  google::protobuf::RepeatedPtrField<v1::Tensor>* tensors_;
  const char* what_;
  std::vector<Slot> slots_;
  int64_t pending_bytes_ = 0;
  int64_t received_bytes_ = 0;
};

/// Indices of the tensors a sender sends in pieces: those whose data is
/// over `inline_bytes` (the rest travel inside the first part).
std::vector<int> PiecedTensors(const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors, int64_t inline_bytes);

/// Sends the pieces of a chunked message through `write`, after its first
/// part: for each index i of `pieced`, `data[k]` (k its position in
/// `pieced`, the bytes of tensor i) in pieces of at most `piece_bytes`
/// (>= 1) bytes, in order. The pieces view `data` (no copies); it must
/// stay valid until the call ends. Returns false as soon as a write fails.
bool WritePieces(const std::function<bool(const OutgoingPart&)>& write, const std::vector<int>& pieced,
                 const std::vector<std::string_view>& data, int64_t piece_bytes);

/// Reads the pieces of a chunked message's pending tensors through `read`
/// (after its first part) into `assembly` (buffers allocated, or
/// AssembleInto), until the end of the stream, then Finish. Errors: INVALID_ARGUMENT for a part
/// that is not a piece, a bad piece or bytes missing at the end (naming
/// the tensor and offset); CANCELLED when `cancelled()`, asked only when
/// the stream ended with bytes missing, says the client ended the call (it
/// may wait a moment for the transport to say so: server/transport/call_ended.h).
absl::Status ReadChunkedPieces(const std::function<bool(IncomingPart*)>& read, const std::function<bool()>& cancelled,
                               TensorAssembler& assembly);

/// Reads one chunked request through `read` (which returns false at the
/// end of the stream): the request part into *req; then `admit(*req,
/// pending_bytes)`, which may refuse it (size limits, backpressure; its
/// error is returned); then the pieces, each checked and copied once into
/// buffers from `allocate` (TensorAssembler), until the end of the stream;
/// then moves the buffers into *req and sets *pieced to their tensors.
/// Errors: INVALID_ARGUMENT for a first part that is not the request, a
/// second request part, a bad piece (TensorAssembler::Add) or bytes missing
/// at the end (naming the tensor and offset); CANCELLED when `cancelled()`,
/// asked once the stream has ended, says the client ended the call.
absl::Status ReadChunkedRequest(const std::function<bool(IncomingPart*)>& read, const std::function<bool()>& cancelled,
                                const std::function<absl::Status(const v1::ScoreRequest&, int64_t)>& admit,
                                const TensorAssembler::Allocate& allocate, v1::ScoreRequest* req,
                                std::vector<int>* pieced);

/// Reads one chunked response through `read` (which returns false at the
/// end of the stream): the response part, then the pieces of its pending
/// outputs until every byte has arrived (later parts are not read).
/// INVALID_ARGUMENT for a malformed part, a first part that is a piece or
/// not a ScoreResponse, a second response part, a bad piece
/// (TensorAssembler::Add), or bytes missing when the stream ends;
/// RESOURCE_EXHAUSTED when its outputs announce more than `max_bytes` in
/// pieces (nothing is allocated for them); NOT_FOUND when the stream ends
/// before its first part.
absl::StatusOr<v1::ScoreResponse> ReadChunkedResponse(const std::function<bool(IncomingPart*)>& read,
                                                      int64_t max_bytes);

/// Writes `resp` through `write` as ScoreResponseParts: whole when it
/// serializes to at most `piece_bytes`, else without the data of its
/// outputs over `inline_bytes`, which follow in pieces of `piece_bytes`.
/// Returns false as soon as a write fails.
bool WriteChunkedResponse(const std::function<bool(const OutgoingPart&)>& write, v1::ScoreResponse resp,
                          int64_t piece_bytes, int64_t inline_bytes);

}  // namespace logprob::chunked
