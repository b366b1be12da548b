#include "common/chunk_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "grpcpp/impl/codegen/proto_buffer_writer.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace logprob::chunked {
namespace {

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed chunked part: ", what));
}

// The largest protobuf field number.
constexpr uint64_t kMaxFieldNumber = (uint64_t{1} << 29) - 1;

// A field's tag and, for wire type 0, its varint; for wire type 2, its
// length (the bytes follow, not yet read). Fixed-size fields are skipped.
struct Field {
  uint64_t number = 0;
  int wire_type = 0;
  uint64_t value = 0;
};

// Sequential reads over the slices of a received part, up to a limit: the
// end of the part, or of the piece being read (Limit).
class Reader {
 public:
  explicit Reader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) left_ += s.size();
  }
  // Bytes before the limit.
  uint64_t available() const { return left_ - floor_; }
  // Limits reads to the next n <= available() bytes, until Unlimit.
  void Limit(uint64_t n) { floor_ = left_ - n; }
  void Unlimit() { floor_ = 0; }
  size_t slice() const { return slice_; }
  size_t pos() const { return pos_; }

  // Skips (or, with dst, copies) n bytes; false past the limit.
  bool Take(uint64_t n, char* dst) {
    if (n > available()) return false;
    left_ -= n;
    while (n > 0) {
      const grpc::Slice& s = slices_[slice_];
      const size_t k = std::min<uint64_t>(n, s.size() - pos_);
      if (dst) {
        std::memcpy(dst, s.begin() + pos_, k);
        dst += k;
      }
      pos_ += k;
      n -= k;
      if (pos_ == s.size() && n > 0) {
        ++slice_;
        pos_ = 0;
      }
    }
    return true;
  }

  // Reads a varint of at most 10 bytes and 64 bits; when false,
  // VarintError says why.
  bool Varint(uint64_t* v) {
    *v = 0;
    overlong_ = false;
    for (int shift = 0;; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      if (shift == 63 && b > 1) {
        overlong_ = true;
        return false;
      }
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
  }
  // The error of the last Varint that failed; `what` names the varint.
  absl::Status VarintError(absl::string_view what) const {
    return Malformed(overlong_ ? absl::StrCat("overlong varint (more than 64 bits) in ", what)
                               : absl::StrCat("truncated ", what));
  }

  // Reads the next field's tag and value (see Field) in `where` (the part
  // or the piece): a valid field number, a supported wire type, its bytes
  // within the limit.
  absl::Status NextField(Field* f, absl::string_view where) {
    uint64_t tag;
    if (!Varint(&tag)) return VarintError(absl::StrCat("tag in the ", where));
    f->number = tag >> 3;
    f->wire_type = static_cast<int>(tag & 7);
    if (f->number == 0 || f->number > kMaxFieldNumber)
      return Malformed(absl::StrCat("invalid field number ", f->number, " in the ", where));
    switch (f->wire_type) {
      case 0:
        if (!Varint(&f->value)) return VarintError(absl::StrCat("varint field ", f->number, " of the ", where));
        return absl::OkStatus();
      case 1:
      case 5:
        if (!Take(f->wire_type == 1 ? 8 : 4, nullptr))
          return Malformed(absl::StrCat("truncated fixed-size field ", f->number, " of the ", where));
        return absl::OkStatus();
      case 2:
        if (!Varint(&f->value)) return VarintError(absl::StrCat("length of field ", f->number, " of the ", where));
        if (f->value > available())
          return Malformed(absl::StrCat("truncated field ", f->number, " of the ", where, ": ", f->value, " bytes, ",
                                        available(), " left"));
        return absl::OkStatus();
      default:
        return Malformed(
            absl::StrCat("unsupported wire type ", f->wire_type, " of field ", f->number, " of the ", where));
    }
  }

 private:
  bool Byte(uint8_t* b) {
    if (available() == 0) return false;
    while (pos_ == slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
    }
    *b = slices_[slice_].begin()[pos_++];
    --left_;
    return true;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0, pos_ = 0;
  uint64_t left_ = 0, floor_ = 0;
  bool overlong_ = false;
};

// A piece's fields; the data is `size` bytes at (data_slice, data_pos).
struct PieceFields {
  int32_t tensor = 0;
  int64_t offset = 0;
  int64_t size = 0;
  size_t data_slice = 0, data_pos = 0;
};

// Reads the n bytes of a TensorPiece at `r` (rules 2 to 8 of
// tests/data/chunk_codec/README.md).
absl::Status ReadPiece(Reader& r, uint64_t n, PieceFields* out) {
  static constexpr const char* kNames[] = {"", "tensor", "offset", "data"};
  static constexpr int kWireTypes[] = {0, 0, 0, 2};
  r.Limit(n);
  bool seen[4] = {false, false, false, false};
  while (r.available() > 0) {
    Field f;
    LOGPROB_RETURN_IF_ERROR(r.NextField(&f, "piece"));
    if (f.number > 3) {
      if (f.wire_type == 2) r.Take(f.value, nullptr);  // unknown: skipped
      continue;
    }
    const int k = static_cast<int>(f.number);
    if (f.wire_type != kWireTypes[k])
      return Malformed(absl::StrCat("the piece's ", kNames[k], " (field ", k, ") has wire type ", f.wire_type, ", not ",
                                    kWireTypes[k]));
    if (seen[k]) return Malformed(absl::StrCat("duplicate ", kNames[k], " in the piece"));
    seen[k] = true;
    const int64_t v = static_cast<int64_t>(f.value);
    if (k == 1) {
      if (v < 0) return Malformed(absl::StrCat("tensor index ", v, " is negative"));
      if (v > INT32_MAX) return Malformed(absl::StrCat("tensor index ", v, " is out of range (above 2^31 - 1)"));
      out->tensor = static_cast<int32_t>(v);
    } else if (k == 2) {
      if (v < 0) return Malformed(absl::StrCat("offset ", v, " is negative"));
      out->offset = v;
    } else {
      out->size = v;
      out->data_slice = r.slice();
      out->data_pos = r.pos();
      r.Take(f.value, nullptr);
    }
  }
  r.Unlimit();
  return absl::OkStatus();
}

}  // namespace

std::string PieceHeader(int32_t tensor, int64_t offset, uint64_t size) {
  const uint64_t t = static_cast<uint64_t>(static_cast<int64_t>(tensor)), o = static_cast<uint64_t>(offset);
  const uint64_t body = 1 + VarintSize(t) + 1 + VarintSize(o) + 1 + VarintSize(size) + size;
  std::string h;
  h.reserve(40);
  h.push_back(0x12);  // field 2 (piece), length-delimited
  PutVarint(body, &h);
  h.push_back(0x08);  // TensorPiece.tensor
  PutVarint(t, &h);
  h.push_back(0x10);  // TensorPiece.offset
  PutVarint(o, &h);
  h.push_back(0x1a);  // TensorPiece.data
  PutVarint(size, &h);
  return h;
}

void ParsedPart::CopyData(char* dst) const {
  size_t slice = data_slice_, pos = data_pos_;
  int64_t n = size_;
  while (n > 0) {
    const grpc::Slice& s = slices_[slice];
    const size_t k = std::min<uint64_t>(static_cast<uint64_t>(n), s.size() - pos);
    std::memcpy(dst, s.begin() + pos, k);
    dst += k;
    n -= static_cast<int64_t>(k);
    ++slice;
    pos = 0;
  }
}

absl::StatusOr<ParsedPart> ParsePart(const IncomingPart& part) {
  ParsedPart out;
  if (grpc::Status st = part.buffer.Dump(&out.slices_); !st.ok()) return Malformed("unreadable buffer");
  Reader r(out.slices_);
  bool has_message = false, has_piece = false;
  while (r.available() > 0) {
    Field f;
    LOGPROB_RETURN_IF_ERROR(r.NextField(&f, "part"));
    if (f.number > 2) {
      if (f.wire_type == 2) r.Take(f.value, nullptr);  // unknown: skipped
      continue;
    }
    const char* kind = f.number == 1 ? "message" : "piece";
    if (f.wire_type != 2)
      return Malformed(absl::StrCat("the ", kind, " (field ", f.number, ") has wire type ", f.wire_type,
                                    ", not 2 (length-delimited)"));
    if (has_message || has_piece)
      return Malformed(has_message == (f.number == 1) ? absl::StrCat("duplicate ", kind)
                                                      : "both a message and a piece");
    if (f.number == 1) {
      out.message_.resize(f.value);
      r.Take(f.value, out.message_.data());
      has_message = true;
    } else {
      PieceFields piece;
      LOGPROB_RETURN_IF_ERROR(ReadPiece(r, f.value, &piece));
      out.tensor_ = piece.tensor;
      out.offset_ = piece.offset;
      out.size_ = piece.size;
      out.data_slice_ = piece.data_slice;
      out.data_pos_ = piece.data_pos;
      has_piece = true;
    }
  }
  if (!has_message && !has_piece) return Malformed("neither a message nor a piece");
  // A data cursor at the very end of a slice moves to the next one.
  while (out.size_ > 0 && out.data_slice_ < out.slices_.size() &&
         out.data_pos_ == out.slices_[out.data_slice_].size()) {
    ++out.data_slice_;
    out.data_pos_ = 0;
  }
  out.is_piece_ = has_piece;
  return out;
}

}  // namespace logprob::chunked

namespace grpc {

Status SerializationTraits<logprob::chunked::OutgoingPart, void>::Serialize(const logprob::chunked::OutgoingPart& part,
                                                                            ByteBuffer* buffer, bool* own_buffer) {
  if (part.message != nullptr)
    return GenericSerialize<ProtoBufferWriter, protobuf::MessageLite>(*part.message, buffer, own_buffer);
  const std::string header = logprob::chunked::PieceHeader(part.tensor, part.offset, part.bytes.size());
  Slice slices[2] = {Slice(header), Slice(part.bytes.data(), part.bytes.size(), Slice::STATIC_SLICE)};
  ByteBuffer tmp(slices, part.bytes.empty() ? 1 : 2);
  buffer->Swap(&tmp);
  *own_buffer = true;
  return Status::OK;
}

}  // namespace grpc
