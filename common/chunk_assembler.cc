#include "common/chunk_assembler.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/input_kind.h"

namespace logprob::chunked {

absl::StatusOr<TensorAssembler> TensorAssembler::Plan(google::protobuf::RepeatedPtrField<v1::Tensor>* tensors,
                                                      const char* what) {
  TensorAssembler a(tensors, what);
  a.slots_.resize(tensors->size());
  for (int i = 0; i < tensors->size(); ++i) {
    const v1::Tensor& t = tensors->Get(i);
    Slot& slot = a.slots_[i];
    slot.size = -1;
    if (!t.data().empty()) continue;               // came whole in the first part
    if (KindOf(t) != InputKind::kBytes) continue;  // a reference: its bytes lie elsewhere (common/input_kind.h)
    const std::string shape = absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
    uint64_t numel = 1;
    for (int64_t d : t.shape()) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat(a.Name(i), ": negative dimension in shape ", shape));
      if (d != 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(d))
        return absl::InvalidArgumentError(absl::StrCat(a.Name(i), ": shape ", shape, " is too large"));
      numel *= static_cast<uint64_t>(d);
    }
    if (numel == 0) continue;  // empty tensor: nothing to come
    const size_t esize = DTypeSize(t.dtype());
    if (esize == 0) return absl::InvalidArgumentError(absl::StrCat(a.Name(i), ": dtype is unspecified"));
    if (numel > (uint64_t{1} << 62) / esize)
      return absl::InvalidArgumentError(absl::StrCat(a.Name(i), ": shape ", shape, " is too large"));
    slot.size = static_cast<int64_t>(numel * esize);
    a.pending_bytes_ += slot.size;
    if (a.pending_bytes_ > (int64_t{1} << 62))
      return absl::InvalidArgumentError(absl::StrCat(what, ": the tensors are too large in all"));
  }
  return a;
}

std::string TensorAssembler::Name(int i) const {
  return absl::StrCat(what_, "[", i, "] \"", tensors_->Get(i).name(), "\"");
}

std::vector<int> TensorAssembler::pending() const {
  std::vector<int> out;
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].size >= 0) out.push_back(static_cast<int>(i));
  return out;
}

void TensorAssembler::AllocateBuffers(const Allocate& allocate) {
  for (Slot& s : slots_)
    if (s.size >= 0) s.buffer = allocate(static_cast<size_t>(s.size));
}

absl::Status TensorAssembler::AssembleInto(char* dst) {
  const std::vector<int> p = pending();
  if (p.size() != 1)
    return absl::InvalidArgumentError(absl::StrCat(what_, ": one tensor in pieces expected, ", p.size(), " announced"));
  slots_[static_cast<size_t>(p[0])].dst = dst;
  return absl::OkStatus();
}

absl::Status TensorAssembler::Add(const ParsedPart& piece) {
  const int i = piece.tensor();
  if (i < 0 || i >= static_cast<int>(slots_.size()))
    return absl::InvalidArgumentError(absl::StrCat("piece at offset ", piece.offset(), " names tensor ", i, " but ",
                                                   what_, " has ", slots_.size(), " tensors"));
  Slot& s = slots_[i];
  if (s.size < 0)
    return absl::InvalidArgumentError(absl::StrCat("piece at offset ", piece.offset(), " for ", Name(i),
                                                   ", whose data came whole in the first part"));
  if (piece.offset() != s.received)
    return absl::InvalidArgumentError(absl::StrCat("piece for ", Name(i), " at offset ", piece.offset(),
                                                   ": expected offset ", s.received,
                                                   " (a tensor's pieces come in order, without gaps)"));
  if (piece.size() > s.size - s.received)
    return absl::InvalidArgumentError(absl::StrCat("piece for ", Name(i), " at offset ", piece.offset(), " with ",
                                                   piece.size(), " bytes ends past the tensor's announced ", s.size,
                                                   " bytes"));
  piece.CopyData((s.dst != nullptr ? s.dst : s.buffer.data()) + s.received);
  s.received += piece.size();
  received_bytes_ += piece.size();
  return absl::OkStatus();
}

std::string TensorAssembler::Position() const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.size >= 0 && s.received < s.size)
      return absl::StrCat(Name(static_cast<int>(i)), " at byte ", s.received, " of ", s.size);
  }
  return absl::StrCat("all ", pending_bytes_, " bytes received");
}

absl::Status TensorAssembler::Finish() {
  if (!complete())
    return absl::InvalidArgumentError(absl::StrCat("the stream ended before all pieces arrived: ", Position(), " (",
                                                   received_bytes_, " of ", pending_bytes_, " bytes received)"));
  for (size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].size >= 0 && slots_[i].dst == nullptr)
      tensors_->Mutable(static_cast<int>(i))->mutable_data()->swap(slots_[i].buffer);
  return absl::OkStatus();
}

std::vector<int> PiecedTensors(const google::protobuf::RepeatedPtrField<v1::Tensor>& tensors, int64_t inline_bytes) {
  std::vector<int> out;
  for (int i = 0; i < tensors.size(); ++i)
    if (static_cast<int64_t>(tensors.Get(i).data().size()) > inline_bytes) out.push_back(i);
  return out;
}

bool WritePieces(const std::function<bool(const OutgoingPart&)>& write, const std::vector<int>& pieced,
                 const std::vector<std::string_view>& data, int64_t piece_bytes) {
  for (size_t k = 0; k < pieced.size(); ++k) {
    const std::string_view bytes = data[k];
    for (size_t off = 0; off < bytes.size(); off += static_cast<size_t>(piece_bytes)) {
      OutgoingPart part;
      part.tensor = pieced[k];
      part.offset = static_cast<int64_t>(off);
      part.bytes = bytes.substr(off, static_cast<size_t>(piece_bytes));
      if (!write(part)) return false;
    }
  }
  return true;
}

absl::Status ReadChunkedRequest(const std::function<bool(IncomingPart*)>& read, const std::function<bool()>& cancelled,
                                const std::function<absl::Status(const v1::ScoreRequest&, int64_t)>& admit,
                                const TensorAssembler::Allocate& allocate, v1::ScoreRequest* req,
                                std::vector<int>* pieced) {
  IncomingPart in;
  if (!read(&in)) {
    if (cancelled()) return absl::CancelledError("the client cancelled the chunked request before its first part");
    return absl::InvalidArgumentError("the chunked request ended before its first part (the request)");
  }
  absl::StatusOr<ParsedPart> first = ParsePart(in);
  if (!first.ok()) return first.status();
  if (first->is_piece())
    return absl::InvalidArgumentError("the first part of a chunked request must carry the request, not a piece");
  if (!req->ParseFromString(first->message()))
    return absl::InvalidArgumentError("the first part's request cannot be parsed as a ScoreRequest");
  absl::StatusOr<TensorAssembler> assembly = TensorAssembler::Plan(req->mutable_inputs(), "inputs");
  if (!assembly.ok()) return assembly.status();
  if (absl::Status st = admit(*req, assembly->pending_bytes()); !st.ok()) return st;
  assembly->AllocateBuffers(allocate);
  if (absl::Status st = ReadChunkedPieces(read, cancelled, *assembly); !st.ok()) return st;
  *pieced = assembly->pending();
  return absl::OkStatus();
}

absl::Status ReadChunkedPieces(const std::function<bool(IncomingPart*)>& read, const std::function<bool()>& cancelled,
                               TensorAssembler& assembly) {
  IncomingPart in;
  while (read(&in)) {
    absl::StatusOr<ParsedPart> part = ParsePart(in);
    if (!part.ok())
      return absl::InvalidArgumentError(absl::StrCat(part.status().message(), " (at ", assembly.Position(), ")"));
    if (!part->is_piece())
      return absl::InvalidArgumentError(absl::StrCat("a second message part arrived at ", assembly.Position(),
                                                     "; only the first part carries the message"));
    if (absl::Status st = assembly.Add(*part); !st.ok()) return st;
  }
  // Every byte arrived: the message is whole, however the stream ended.
  // Otherwise the client either ended the call (cancel, deadline) or
  // closed its side too early; only then is `cancelled` asked (it may wait).
  if (!assembly.complete() && cancelled())
    return absl::CancelledError(absl::StrCat("the client cancelled the chunked message at ", assembly.Position()));
  return assembly.Finish();
}

absl::StatusOr<v1::ScoreResponse> ReadChunkedResponse(const std::function<bool(IncomingPart*)>& read,
                                                      int64_t max_bytes) {
  IncomingPart in;
  if (!read(&in)) return absl::NotFoundError("the chunked response ended before its first part");
  absl::StatusOr<ParsedPart> first = ParsePart(in);
  if (!first.ok()) return first.status();
  if (first->is_piece()) return absl::InvalidArgumentError("the first part of a chunked response is a piece");
  v1::ScoreResponse resp;
  if (!resp.ParseFromString(first->message()))
    return absl::InvalidArgumentError("the first part's response cannot be parsed as a ScoreResponse");
  absl::StatusOr<TensorAssembler> assembly = TensorAssembler::Plan(resp.mutable_outputs(), "outputs");
  if (!assembly.ok()) return assembly.status();
  if (assembly->pending_bytes() > max_bytes)
    return absl::ResourceExhaustedError(absl::StrCat("the response announces ", assembly->pending_bytes(),
                                                     " bytes in pieces, over the reader's limit of ", max_bytes));
  assembly->AllocateBuffers([](size_t n) { return std::string(n, '\0'); });
  while (!assembly->complete() && read(&in)) {
    absl::StatusOr<ParsedPart> part = ParsePart(in);
    if (!part.ok()) return part.status();
    if (!part->is_piece()) return absl::InvalidArgumentError("a second response part");
    if (absl::Status st = assembly->Add(*part); !st.ok()) return st;
  }
  if (absl::Status st = assembly->Finish(); !st.ok()) return st;
  return resp;
}

bool WriteChunkedResponse(const std::function<bool(const OutgoingPart&)>& write, v1::ScoreResponse resp,
                          int64_t piece_bytes, int64_t inline_bytes) {
  std::vector<int> pieced;
  if (static_cast<int64_t>(resp.ByteSizeLong()) > piece_bytes) pieced = PiecedTensors(resp.outputs(), inline_bytes);
  std::vector<std::string> data(pieced.size());
  for (size_t k = 0; k < pieced.size(); ++k) data[k].swap(*resp.mutable_outputs(pieced[k])->mutable_data());
  v1::ScoreResponsePart first;
  *first.mutable_response() = std::move(resp);
  OutgoingPart part;
  part.message = &first;
  if (!write(part)) return false;
  const std::vector<std::string_view> views(data.begin(), data.end());
  return WritePieces(write, pieced, views, piece_bytes);
}

}  // namespace logprob::chunked
