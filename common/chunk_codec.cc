#include "common/chunk_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
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

// Sequential reads over the slices of a received part.
class Reader {
 public:
  explicit Reader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) left_ += s.size();
  }
  uint64_t left() const { return left_; }
  size_t slice() const { return slice_; }
  size_t pos() const { return pos_; }

  bool Byte(uint8_t* b) {
    if (left_ == 0) return false;
    while (pos_ == slices_[slice_].size()) {
      ++slice_;
      pos_ = 0;
    }
    *b = slices_[slice_].begin()[pos_++];
    --left_;
    return true;
  }
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }
  // Skips (or, with dst, copies) n bytes.
  bool Take(uint64_t n, char* dst) {
    if (n > left_) return false;
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
  // Skips a field of wire type `wt`.
  bool SkipField(int wt) {
    uint64_t v;
    switch (wt) {
      case 0:
        return Varint(&v);
      case 1:
        return Take(8, nullptr);
      case 2:
        return Varint(&v) && Take(v, nullptr);
      case 5:
        return Take(4, nullptr);
      default:
        return false;
    }
  }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0, pos_ = 0;
  uint64_t left_ = 0;
};

absl::Status Malformed(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed chunked part: ", what));
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
  while (r.left() > 0) {
    uint64_t tag;
    if (!r.Varint(&tag)) return Malformed("truncated tag");
    const int field = static_cast<int>(tag >> 3), wt = static_cast<int>(tag & 7);
    if ((field == 1 || field == 2) && wt != 2) return Malformed("field 1 or 2 is not length-delimited");
    if (field == 1) {
      uint64_t n;
      if (!r.Varint(&n) || n > r.left()) return Malformed("truncated message");
      out.message_.resize(n);
      r.Take(n, out.message_.data());
      has_message = true;
    } else if (field == 2) {
      uint64_t n;
      if (!r.Varint(&n) || n > r.left()) return Malformed("truncated piece");
      const uint64_t end = r.left() - n;
      bool has_data = false;
      while (r.left() > end) {
        uint64_t t;
        if (!r.Varint(&t)) return Malformed("truncated piece field");
        const int f = static_cast<int>(t >> 3), w = static_cast<int>(t & 7);
        uint64_t v;
        if (f == 1 && w == 0) {
          if (!r.Varint(&v)) return Malformed("truncated tensor index");
          const int64_t s = static_cast<int64_t>(v);
          if (s < 0 || s > INT32_MAX) return Malformed(absl::StrCat("tensor index ", s, " is out of range"));
          out.tensor_ = static_cast<int32_t>(s);
        } else if (f == 2 && w == 0) {
          if (!r.Varint(&v)) return Malformed("truncated offset");
          out.offset_ = static_cast<int64_t>(v);
          if (out.offset_ < 0) return Malformed(absl::StrCat("offset ", out.offset_, " is negative"));
        } else if (f == 3 && w == 2) {
          if (!r.Varint(&v) || v > r.left() - end) return Malformed("truncated piece data");
          out.size_ = static_cast<int64_t>(v);
          out.data_slice_ = r.slice();
          out.data_pos_ = r.pos();
          r.Take(v, nullptr);
          has_data = true;
        } else if (!r.SkipField(w)) {
          return Malformed("truncated unknown field");
        }
      }
      if (r.left() != end) return Malformed("piece fields run past the piece");
      if (!has_data) out.size_ = 0;
      has_piece = true;
    } else if (!r.SkipField(wt)) {
      return Malformed("truncated unknown field");
    }
  }
  if (has_message == has_piece)
    return Malformed(has_piece ? "both a message and a piece" : "neither a message nor a piece");
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
