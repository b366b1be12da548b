// libFuzzer target: ScoreChunked part streams (common/chunk_codec.h,
// common/chunk_assembler.h), both directions: a request's parts through
// ReadChunkedRequest (what logprob-server runs, with an admission limit
// and pooled-style buffers) and a response's parts through
// ReadChunkedResponse (what the C++ client runs, client/chunked_call.cc).
//
// The input is spent on a stream: the first part is either fuzz bytes or a
// structured request/response (tensors of fuzzed names, dtypes and shapes,
// data inline or left to the pieces), then parts that are fuzz bytes or
// structured pieces (a tensor, an offset near the expected one, data).
// Or the input is the parts themselves, framed (the seeds: golden-like
// requests and responses cut into pieces by gen_fuzz_seeds).
// Whatever the stream, the readers must return a status, never crash; when
// they succeed, every pieced tensor holds exactly the bytes of its pieces,
// in order, as ParsePart reads them, and its announced size; a request
// over the admission limit never gets its buffers. A violated invariant
// traps.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "common/chunk_assembler.h"
#include "common/chunk_codec.h"
#include "common/dtype.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "logprob/v1/logprob.pb.h"

namespace {

namespace v1 = logprob::v1;
namespace chunked = logprob::chunked;

#define CHECK(cond)                                                                              \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      std::fprintf(stderr, "fuzz_chunked: invariant violated: %s (line %d)\n", #cond, __LINE__); \
      __builtin_trap();                                                                          \
    }                                                                                            \
  } while (0)

constexpr int64_t kAdmitBytes = int64_t{1} << 20;        // the fuzzed server's --max-request-bytes
constexpr int64_t kMaxResponseBytes = int64_t{1} << 20;  // the fuzzed client's limit

/// Field 1 (the message) of a ScoreRequestPart / ScoreResponsePart.
std::string MessagePart(const std::string& message) {
  std::string out(1, '\x0a');
  uint64_t n = message.size();
  do {
    out.push_back(static_cast<char>((n & 0x7f) | (n > 0x7f ? 0x80 : 0)));
    n >>= 7;
  } while (n);
  return out + message;
}

/// A structured first part's tensors: up to 3, each with a fuzzed name,
/// dtype and shape, its data inline or empty (pending: sent in pieces).
template <class Tensors>
void FillTensors(FuzzedDataProvider& p, Tensors* tensors) {
  static const char* const kNames[] = {"logits", "input_ids", "cu_seqlens", "token_logprobs", "x", ""};
  const int n = p.ConsumeIntegralInRange(0, 3);
  for (int i = 0; i < n; ++i) {
    v1::Tensor* t = tensors->Add();
    t->set_name(kNames[p.ConsumeIntegralInRange<size_t>(0, 5)]);
    t->set_dtype(static_cast<v1::DType>(p.ConsumeIntegralInRange(0, 7)));
    const int rank = p.ConsumeIntegralInRange(0, 3);
    for (int d = 0; d < rank; ++d)
      t->add_shape(p.ConsumeBool() ? p.ConsumeIntegralInRange<int64_t>(0, 64) : p.ConsumeIntegral<int64_t>());
    if (p.ConsumeIntegralInRange(0, 3) == 0) t->set_data(p.ConsumeRandomLengthString(256));
  }
}

/// Bytes `size` of tensor `tensor` at `offset`: the piece as a sender writes it.
std::string Piece(int32_t tensor, int64_t offset, const std::string& data) {
  return chunked::PieceHeader(tensor, offset, data.size()) + data;
}

/// The stream: a first part and then pieces, each structured or raw.
std::vector<std::string> Stream(FuzzedDataProvider& p, bool response) {
  std::vector<std::string> parts;
  if (p.ConsumeIntegralInRange(0, 7) == 0) {
    parts.push_back(p.ConsumeRandomLengthString(4096));
  } else if (response) {
    v1::ScoreResponse r;
    r.set_id("fuzz");
    FillTensors(p, r.mutable_outputs());
    parts.push_back(MessagePart(r.SerializeAsString()));
  } else {
    v1::ScoreRequest r;
    r.set_id("fuzz");
    FillTensors(p, r.mutable_inputs());
    parts.push_back(MessagePart(r.SerializeAsString()));
  }
  std::map<int32_t, int64_t> next;  // tensor -> the offset a well-behaved sender would send
  const int n = p.ConsumeIntegralInRange(0, 16);
  for (int i = 0; i < n && p.remaining_bytes() > 0; ++i) {
    switch (p.ConsumeIntegralInRange(0, 5)) {
      case 0:
        parts.push_back(p.ConsumeRandomLengthString(512));
        break;
      case 1:  // a second message part
        parts.push_back(MessagePart(p.ConsumeRandomLengthString(64)));
        break;
      default: {
        const int32_t tensor = p.ConsumeBool() ? p.ConsumeIntegralInRange(0, 3) : p.ConsumeIntegral<int32_t>();
        int64_t offset = next[tensor];
        if (p.ConsumeIntegralInRange(0, 7) == 0) offset += p.ConsumeIntegralInRange<int64_t>(-8, 8);
        const std::string data = p.ConsumeRandomLengthString(1024);
        parts.push_back(Piece(tensor, offset, data));
        next[tensor] = offset + static_cast<int64_t>(data.size());
      }
    }
  }
  return parts;
}

/// A reader over `parts`, as a gRPC stream hands them over.
std::function<bool(chunked::IncomingPart*)> Reader(const std::vector<std::string>& parts, size_t* at) {
  return [&parts, at](chunked::IncomingPart* in) {
    if (*at >= parts.size()) return false;
    grpc::Slice slice(parts[*at].data(), parts[*at].size());
    in->buffer = grpc::ByteBuffer(&slice, 1);
    ++*at;
    return true;
  };
}

/// tensor -> its bytes from the pieces among parts[1, end), in order, as ParsePart reads them.
std::map<int32_t, std::string> PieceBytes(const std::vector<std::string>& parts, size_t end) {
  std::map<int32_t, std::string> bytes;
  for (size_t i = 1; i < end; ++i) {
    grpc::Slice slice(parts[i].data(), parts[i].size());
    chunked::IncomingPart in{grpc::ByteBuffer(&slice, 1)};
    absl::StatusOr<chunked::ParsedPart> part = chunked::ParsePart(in);
    CHECK(part.ok() && part->is_piece());  // a successful read accepted every part it read
    std::string& b = bytes[part->tensor()];
    CHECK(part->offset() == static_cast<int64_t>(b.size()));
    const size_t at = b.size();
    b.resize(at + static_cast<size_t>(part->size()));
    part->CopyData(b.data() + at);
  }
  return bytes;
}

/// A successful read's tensors: the pieced ones hold their pieces' bytes,
/// every tensor holds its announced size.
template <class Tensors>
void CheckAssembled(const Tensors& tensors, const std::vector<int>& pieced,
                    const std::map<int32_t, std::string>& pieces) {
  for (const auto& [tensor, bytes] : pieces) {
    CHECK(tensor >= 0 && tensor < tensors.size());
    CHECK(tensors.Get(tensor).data() == bytes);
  }
  for (int i : pieced) {
    const v1::Tensor& t = tensors.Get(i);
    int64_t bytes = static_cast<int64_t>(logprob::DTypeSize(t.dtype()));
    for (int64_t d : t.shape()) CHECK(d >= 0 && !__builtin_mul_overflow(bytes, d, &bytes));  // Plan checked them
    CHECK(static_cast<int64_t>(t.data().size()) == bytes);
    CHECK(bytes > 0 && pieces.count(i));
  }
}

void Request(const std::vector<std::string>& parts) {
  size_t at = 0;
  int64_t admitted = -1;
  bool allocated = false;
  v1::ScoreRequest req;
  std::vector<int> pieced;
  const absl::Status st = chunked::ReadChunkedRequest(
      Reader(parts, &at), [] { return false; },
      [&admitted](const v1::ScoreRequest&, int64_t bytes) {
        admitted = bytes;
        return bytes > kAdmitBytes ? absl::ResourceExhaustedError("over the limit") : absl::OkStatus();
      },
      [&](size_t n) {
        CHECK(admitted >= 0 && admitted <= kAdmitBytes);  // buffers only for an admitted request
        allocated = true;
        return std::string(n, '\0');
      },
      &req, &pieced);
  if (!st.ok()) {
    CHECK(st.code() == absl::StatusCode::kInvalidArgument || st.code() == absl::StatusCode::kResourceExhausted);
    CHECK(!st.message().empty());
    return;
  }
  CHECK(at == parts.size());  // a request is read to the end of its stream
  CHECK(admitted >= 0 && admitted <= kAdmitBytes);
  CheckAssembled(req.inputs(), pieced, PieceBytes(parts, at));
  int64_t total = 0;
  for (int i : pieced) total += static_cast<int64_t>(req.inputs(i).data().size());
  CHECK(total == admitted);
  CHECK(allocated || pieced.empty());
}

void Response(const std::vector<std::string>& parts) {
  size_t at = 0;
  const absl::StatusOr<v1::ScoreResponse> resp = chunked::ReadChunkedResponse(Reader(parts, &at), kMaxResponseBytes);
  if (!resp.ok()) {
    CHECK(resp.status().code() == absl::StatusCode::kInvalidArgument ||
          resp.status().code() == absl::StatusCode::kResourceExhausted ||
          resp.status().code() == absl::StatusCode::kNotFound);
    CHECK(!resp.status().message().empty());
    return;
  }
  // The pieced outputs: the first part's pending ones (the assembler's own rule).
  grpc::Slice slice(parts[0].data(), parts[0].size());
  chunked::IncomingPart first{grpc::ByteBuffer(&slice, 1)};
  v1::ScoreResponse header;
  CHECK(header.ParseFromString(chunked::ParsePart(first)->message()));
  absl::StatusOr<chunked::TensorAssembler> plan = chunked::TensorAssembler::Plan(header.mutable_outputs(), "outputs");
  CHECK(plan.ok() && plan->pending_bytes() <= kMaxResponseBytes);
  CheckAssembled(resp->outputs(), plan->pending(), PieceBytes(parts, at));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // unparsable bytes are expected here
  return 0;
}

/// Framed input (the seeds: real streams): parts as [u32 little-endian length][bytes].
std::vector<std::string> Framed(const uint8_t* data, size_t size) {
  std::vector<std::string> parts;
  while (size >= 4) {
    const uint32_t n = static_cast<uint32_t>(data[0]) | static_cast<uint32_t>(data[1]) << 8 |
                       static_cast<uint32_t>(data[2]) << 16 | static_cast<uint32_t>(data[3]) << 24;
    data += 4;
    size -= 4;
    const size_t take = n < size ? n : size;
    parts.emplace_back(reinterpret_cast<const char*>(data), take);
    data += take;
    size -= take;
  }
  return parts;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // First byte: bit 0 response (else request), bit 1 framed parts (else structured).
  const bool response = data[0] & 1;
  std::vector<std::string> parts;
  if (data[0] & 2) {
    parts = Framed(data + 1, size - 1);
  } else {
    FuzzedDataProvider p(data + 1, size - 1);
    parts = Stream(p, response);
  }
  if (response) Response(parts);
  else Request(parts);
  return 0;
}
