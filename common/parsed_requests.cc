#include "common/parsed_requests.h"

#include <climits>
#include <map>
#include <utility>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/slice.h"

namespace logprob {
namespace {

/// The slices of a received message as a protobuf input stream that drops
/// each slice once the parser has moved past it, so a large message is
/// not held twice (its received bytes and the parsed copy) while parsing.
class ReleasingSliceStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit ReleasingSliceStream(std::vector<grpc::Slice> slices) : slices_(std::move(slices)) {}

  bool Next(const void** data, int* size) override {
    if (backed_up_ > 0) {  // the tail of the last slice again
      const grpc::Slice& s = slices_[next_ - 1];
      *data = s.begin() + s.size() - backed_up_;
      *size = backed_up_;
      bytes_ += backed_up_;
      backed_up_ = 0;
      return true;
    }
    if (next_ > 0) slices_[next_ - 1] = grpc::Slice();  // the parser is done with it
    if (next_ == slices_.size()) return false;
    const grpc::Slice& s = slices_[next_++];
    *data = s.begin();
    *size = static_cast<int>(s.size());
    bytes_ += *size;
    return true;
  }
  void BackUp(int count) override {
    backed_up_ = count;
    bytes_ -= count;
  }
  bool Skip(int count) override {
    const void* data = nullptr;
    int size = 0;
    while (count > 0) {
      if (!Next(&data, &size)) return false;
      if (size > count) {
        BackUp(size - count);
        return true;
      }
      count -= size;
    }
    return true;
  }
  int64_t ByteCount() const override { return bytes_; }

 private:
  std::vector<grpc::Slice> slices_;
  size_t next_ = 0;    // the next slice Next returns
  int backed_up_ = 0;  // bytes of slice next_ - 1 given back (BackUp)
  int64_t bytes_ = 0;  // bytes returned and not given back
};

/// Bytes fields at least this long are read straight into a string of
/// their size (ParseLarge).
constexpr uint32_t kLargeField = uint32_t{1} << 20;

/// A bytes field ParseLarge read itself: where it goes.
struct LargeField {
  std::vector<std::pair<const google::protobuf::FieldDescriptor*, int>>
      path;  // submessages (field, index; -1 singular)
  const google::protobuf::FieldDescriptor* field;
  std::string bytes;
};

/// Copies the fields of one message of type `type` (until `in`'s limit)
/// into *skeleton, except bytes fields of kLargeField bytes or more, which
/// go to *large with their path; submessages are walked the same way.
/// False on bytes that are no valid wire format.
bool Walk(google::protobuf::io::CodedInputStream* in, const google::protobuf::Descriptor* type,
          std::vector<std::pair<const google::protobuf::FieldDescriptor*, int>>* path, std::string* skeleton,
          std::vector<LargeField>* large) {
  using google::protobuf::FieldDescriptor;
  using google::protobuf::internal::WireFormatLite;
  std::map<int, int> seen;  // repeated message fields: occurrences so far
  for (;;) {
    const uint32_t tag = in->ReadTag();
    if (tag == 0) return in->ConsumedEntireMessage();  // the end, not a tag 0
    const int number = static_cast<int>(WireFormatLite::GetTagFieldNumber(tag));
    const FieldDescriptor* field = type->FindFieldByNumber(number);
    const auto wire = WireFormatLite::GetTagWireType(tag);
    std::string piece;
    {
      google::protobuf::io::StringOutputStream piece_sink(&piece);
      google::protobuf::io::CodedOutputStream out(&piece_sink);
      if (wire != WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        if (!WireFormatLite::SkipField(in, tag, &out)) return false;
      } else {
        uint32_t length = 0;
        if (!in->ReadVarint32(&length)) return false;
        const bool message = field != nullptr && field->type() == FieldDescriptor::TYPE_MESSAGE;
        if (message) {
          const int index = field->is_repeated() ? seen[number]++ : -1;
          path->emplace_back(field, index);
          std::string sub;
          const auto limit = in->PushLimit(static_cast<int>(length));
          if (!Walk(in, field->message_type(), path, &sub, large)) return false;
          in->PopLimit(limit);
          path->pop_back();
          out.WriteTag(tag);
          out.WriteVarint32(static_cast<uint32_t>(sub.size()));
          out.WriteRaw(sub.data(), static_cast<int>(sub.size()));
        } else if (field != nullptr && field->type() == FieldDescriptor::TYPE_BYTES && !field->is_repeated() &&
                   length >= kLargeField) {
          LargeField f{*path, field, std::string()};
          f.bytes.resize(length);  // exact: protobuf would grow it by appending past 50 MB
          if (!in->ReadRaw(f.bytes.data(), static_cast<int>(length))) return false;
          large->push_back(std::move(f));
        } else {
          std::string bytes;
          if (!in->ReadString(&bytes, static_cast<int>(length))) return false;
          out.WriteTag(tag);
          out.WriteVarint32(length);
          out.WriteRaw(bytes.data(), static_cast<int>(bytes.size()));
        }
      }
    }
    skeleton->append(piece);
  }
}

/// Parses `stream` into *msg as ParseFromZeroCopyStream does, but with
/// large bytes fields (tensor data) read once into strings of their exact
/// size: protobuf reserves at most 50 MB for a string and grows it by
/// appending, so a 64 MiB tensor took a 95 MiB allocation and a copy
/// through a 48 MiB one while it was parsed.
bool ParseLarge(google::protobuf::io::ZeroCopyInputStream* stream, google::protobuf::Message* msg) {
  std::string skeleton;
  std::vector<LargeField> large;
  {
    google::protobuf::io::CodedInputStream in(stream);
    in.SetTotalBytesLimit(INT_MAX);
    std::vector<std::pair<const google::protobuf::FieldDescriptor*, int>> path;
    if (!Walk(&in, msg->GetDescriptor(), &path, &skeleton, &large)) return false;
  }
  if (!msg->ParseFromString(skeleton)) return false;
  for (LargeField& f : large) {
    google::protobuf::Message* at = msg;
    for (const auto& [field, index] : f.path) {
      const google::protobuf::Reflection* r = at->GetReflection();
      if (index < 0) {
        at = r->MutableMessage(at, field);
      } else {
        if (index >= r->FieldSize(*at, field)) return false;
        at = r->MutableRepeatedMessage(at, field, index);
      }
    }
    at->GetReflection()->SetString(at, f.field, std::move(f.bytes));
  }
  return true;
}

}  // namespace

grpc::Status ParseRequest(RawMessage* raw, google::protobuf::Message* msg, const char* method,
                          const std::string& what) {
  const bool large = raw->buffer.Length() >= kLargeField;
  std::vector<grpc::Slice> slices;
  bool ok = raw->buffer.Dump(&slices).ok();
  raw->buffer.Clear();  // the slices hold the bytes now, dropped as they are parsed
  if (ok) {
    ReleasingSliceStream stream(std::move(slices));
    ok = large ? ParseLarge(&stream, msg) : msg->ParseFromZeroCopyStream(&stream);
  }
  if (ok) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(method) + ": " + what + " is not a valid " +
                                                              msg->GetTypeName() + " message (protobuf parse failed)");
}

}  // namespace logprob
