// The ScoreChunked part codec (common/chunk_codec.h) against protobuf's own
// serialization: pieces written by OutgoingPart parse as ScoreRequestPart,
// protobuf-written parts parse with ParsePart however gRPC slices them,
// malformed parts are INVALID_ARGUMENT; against the golden parts of
// tests/data/chunk_codec (GoldenParts: the rules shared with the Python
// client's codec, client/python/tests/test_codec_golden.py); and
// TensorAssembler's checks.
#include "common/chunk_codec.h"

#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "common/chunk_assembler.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "logprob/v1/logprob.pb.h"
#include "nlohmann/json.hpp"

namespace logprob::chunked {
namespace {

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

/// `bytes` as a ByteBuffer cut into slices at the given offsets.
IncomingPart Sliced(const std::string& bytes, std::vector<size_t> cuts) {
  cuts.push_back(bytes.size());
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t c : cuts) {
    slices.emplace_back(bytes.data() + at, c - at);
    at = c;
  }
  IncomingPart p;
  p.buffer = grpc::ByteBuffer(slices.data(), slices.size());
  return p;
}

TEST(ChunkCodec, OutgoingPieceIsAScoreRequestPart) {
  const std::string data = "0123456789abcdef";
  OutgoingPart out;
  out.tensor = 2;
  out.offset = int64_t{1} << 35;
  out.bytes = data;
  grpc::ByteBuffer buffer;
  bool own = false;
  ASSERT_TRUE((grpc::SerializationTraits<OutgoingPart>::Serialize(out, &buffer, &own)).ok());
  v1::ScoreRequestPart part;
  ASSERT_TRUE(part.ParseFromString(Flatten(buffer)));
  ASSERT_TRUE(part.has_piece());
  EXPECT_EQ(part.piece().tensor(), 2);
  EXPECT_EQ(part.piece().offset(), int64_t{1} << 35);
  EXPECT_EQ(part.piece().data(), data);
  EXPECT_EQ(PieceHeader(2, int64_t{1} << 35, data.size()) + data, part.SerializeAsString());
}

TEST(ChunkCodec, ProtobufPartsParseHoweverTheyAreSliced) {
  std::mt19937 rng(1);
  std::string data(5000, '\0');
  for (char& c : data) c = static_cast<char>(rng());
  v1::ScoreRequestPart part;
  part.mutable_piece()->set_tensor(1);
  part.mutable_piece()->set_offset(123456);
  part.mutable_piece()->set_data(data);
  const std::string bytes = part.SerializeAsString();
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<size_t> cuts;
    for (size_t at = 0; at < bytes.size();) {
      at += 1 + rng() % 700;
      if (at < bytes.size()) cuts.push_back(at);
    }
    absl::StatusOr<ParsedPart> p = ParsePart(Sliced(bytes, cuts));
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(p->is_piece());
    EXPECT_EQ(p->tensor(), 1);
    EXPECT_EQ(p->offset(), 123456);
    ASSERT_EQ(p->size(), 5000);
    std::string got(5000, '\0');
    p->CopyData(got.data());
    EXPECT_EQ(got, data);
  }
  v1::ScoreRequestPart first;
  first.mutable_request()->set_id("r1");
  absl::StatusOr<ParsedPart> m = ParsePart(Sliced(first.SerializeAsString(), {1}));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->is_piece());
  v1::ScoreRequest req;
  ASSERT_TRUE(req.ParseFromString(m->message()));
  EXPECT_EQ(req.id(), "r1");
}

TEST(ChunkCodec, MalformedPartsAreInvalidArgument) {
  v1::ScoreRequestPart part;
  part.mutable_piece()->set_data("abcdef");
  const std::string bytes = part.SerializeAsString();
  for (size_t n = 1; n < bytes.size(); ++n) {
    absl::StatusOr<ParsedPart> p = ParsePart(Sliced(bytes.substr(0, n), {}));
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
}

/// A case of tests/data/chunk_codec/parts.json (see README.md there).
struct GoldenPart {
  std::string name;
  std::string part;       // the part's bytes
  nlohmann::json expect;  // {"message": hex} | {"piece": {...}} | {"error": keyword}
  bool canonical = false;
};

std::vector<GoldenPart> LoadGoldenParts() {
  std::ifstream in(std::string(LOGPROB_CHUNK_CODEC_GOLDEN_DIR) + "/parts.json");
  EXPECT_TRUE(in.good()) << LOGPROB_CHUNK_CODEC_GOLDEN_DIR << "/parts.json";
  const nlohmann::json doc = nlohmann::json::parse(in);
  std::vector<GoldenPart> out;
  for (const nlohmann::json& c : doc.at("cases")) {
    out.push_back({c.at("name").get<std::string>(), absl::HexStringToBytes(c.at("part").get<std::string>()),
                   c.at("expect"), c.value("canonical", false)});
  }
  return out;
}

/// Whether ParsePart(`in`) gives the case's expected result.
testing::AssertionResult GivesGoldenResult(const GoldenPart& c, const IncomingPart& in) {
  absl::StatusOr<ParsedPart> p = ParsePart(in);
  if (c.expect.contains("error")) {
    const std::string keyword = c.expect["error"].get<std::string>();
    if (p.ok()) return testing::AssertionFailure() << "parsed, expected an error with \"" << keyword << "\"";
    if (p.status().code() != absl::StatusCode::kInvalidArgument ||
        !absl::StartsWith(p.status().message(), "malformed chunked part: ") ||
        !absl::StrContains(p.status().message(), keyword))
      return testing::AssertionFailure() << p.status() << ", expected INVALID_ARGUMENT \"malformed chunked part: "
                                         << "...\" with \"" << keyword << "\"";
    return testing::AssertionSuccess();
  }
  if (!p.ok()) return testing::AssertionFailure() << p.status() << ", expected " << c.expect.dump();
  if (c.expect.contains("message")) {
    const std::string got = p->is_piece() ? "a piece" : "message " + absl::BytesToHexString(p->message());
    if (got != "message " + c.expect["message"].get<std::string>())
      return testing::AssertionFailure() << "got " << got << ", expected " << c.expect.dump();
    return testing::AssertionSuccess();
  }
  if (!p->is_piece()) return testing::AssertionFailure() << "got a message, expected " << c.expect.dump();
  std::string data(p->size(), '\0');
  p->CopyData(data.data());
  const nlohmann::json got = {
      {"piece", {{"tensor", p->tensor()}, {"offset", p->offset()}, {"data", absl::BytesToHexString(data)}}}};
  if (got != c.expect) return testing::AssertionFailure() << "got " << got.dump() << ", expected " << c.expect.dump();
  return testing::AssertionSuccess();
}

TEST(GoldenParts, ParsePartGivesTheGoldenResultHoweverThePartIsSliced) {
  const std::vector<GoldenPart> cases = LoadGoldenParts();
  ASSERT_GE(cases.size(), 50u);
  for (const GoldenPart& c : cases) {
    // One slice, two slices cut at every byte, a slice per byte; the
    // first failure of a case is reported.
    std::vector<std::pair<std::string, std::vector<size_t>>> slicings = {{"one slice", {}}};
    std::vector<size_t> every_byte;
    for (size_t at = 1; at < c.part.size(); ++at) {
      slicings.push_back({absl::StrCat("two slices cut at byte ", at), {at}});
      every_byte.push_back(at);
    }
    slicings.push_back({"a slice per byte", every_byte});
    for (const auto& [how, cuts] : slicings) {
      const testing::AssertionResult result = GivesGoldenResult(c, Sliced(c.part, cuts));
      EXPECT_TRUE(result) << c.name << " (" << how << ")";
      if (!result) break;
    }
  }
}

TEST(GoldenParts, PieceHeaderAndOutgoingPartWriteTheCanonicalPieces) {
  int checked = 0;
  for (const GoldenPart& c : LoadGoldenParts()) {
    if (!c.canonical) continue;
    SCOPED_TRACE(c.name);
    const nlohmann::json& piece = c.expect.at("piece");
    const int32_t tensor = piece.at("tensor").get<int32_t>();
    const int64_t offset = piece.at("offset").get<int64_t>();
    const std::string data = absl::HexStringToBytes(piece.at("data").get<std::string>());
    EXPECT_EQ(absl::BytesToHexString(PieceHeader(tensor, offset, data.size())),
              absl::BytesToHexString(c.part.substr(0, c.part.size() - data.size())));
    OutgoingPart out;
    out.tensor = tensor;
    out.offset = offset;
    out.bytes = data;
    grpc::ByteBuffer buffer;
    bool own = false;
    ASSERT_TRUE((grpc::SerializationTraits<OutgoingPart>::Serialize(out, &buffer, &own)).ok());
    EXPECT_EQ(absl::BytesToHexString(Flatten(buffer)), absl::BytesToHexString(c.part));
    ++checked;
  }
  EXPECT_GE(checked, 6);
}

/// A piece part of tensor `tensor` at `offset`, parsed as the receiver sees it.
ParsedPart Piece(int tensor, int64_t offset, const std::string& data) {
  v1::ScoreRequestPart p;
  p.mutable_piece()->set_tensor(tensor);
  p.mutable_piece()->set_offset(offset);
  p.mutable_piece()->set_data(data);
  return *ParsePart(Sliced(p.SerializeAsString(), {}));
}

TEST(TensorAssembler, ChecksAnnouncedSizesAndPieceOrder) {
  google::protobuf::RepeatedPtrField<v1::Tensor> tensors;
  v1::Tensor* logits = tensors.Add();
  logits->set_name("logits");
  logits->set_dtype(v1::BF16);
  logits->add_shape(3);
  logits->add_shape(4);  // 24 bytes in pieces
  v1::Tensor* ids = tensors.Add();
  ids->set_name("input_ids");
  ids->set_dtype(v1::I64);
  ids->add_shape(3);
  ids->set_data(std::string(24, '\1'));  // whole in the first part
  absl::StatusOr<TensorAssembler> a = TensorAssembler::Plan(&tensors, "inputs");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->pending_bytes(), 24);
  EXPECT_EQ(a->pending(), std::vector<int>{0});
  a->AllocateBuffers([](size_t n) { return std::string(n, '\0'); });
  const auto piece = Piece;
  EXPECT_TRUE(a->Add(piece(0, 0, std::string(10, 'a'))).ok());
  absl::Status st = a->Add(piece(0, 12, "b"));
  EXPECT_NE(st.message().find("inputs[0] \"logits\" at offset 12: expected offset 10"), std::string::npos) << st;
  st = a->Add(piece(1, 0, "b"));
  EXPECT_NE(st.message().find("inputs[1] \"input_ids\", whose data came whole"), std::string::npos) << st;
  st = a->Add(piece(0, 10, std::string(15, 'c')));
  EXPECT_NE(st.message().find("ends past the tensor's announced 24 bytes"), std::string::npos) << st;
  st = a->Finish();
  EXPECT_NE(st.message().find("inputs[0] \"logits\" at byte 10 of 24"), std::string::npos) << st;
  EXPECT_TRUE(a->Add(piece(0, 10, std::string(14, 'c'))).ok());
  ASSERT_TRUE(a->Finish().ok());
  EXPECT_EQ(tensors.Get(0).data(), std::string(10, 'a') + std::string(14, 'c'));

  google::protobuf::RepeatedPtrField<v1::Tensor> bad;
  v1::Tensor* t = bad.Add();
  t->set_name("logits");
  t->add_shape(2);
  EXPECT_NE(TensorAssembler::Plan(&bad, "inputs").status().message().find("inputs[0] \"logits\": dtype is unspecified"),
            std::string::npos);
}

TEST(TensorAssembler, AssembleIntoWritesThePiecesToTheCallersMemory) {
  // An lm_head update's rows: one tensor in pieces, written straight into
  // the staged file; Finish leaves the tensor's data empty.
  google::protobuf::RepeatedPtrField<v1::Tensor> tensors;
  v1::Tensor* rows = tensors.Add();
  rows->set_name("rows");
  rows->set_dtype(v1::F32);
  rows->add_shape(2);
  rows->add_shape(3);  // 24 bytes in pieces
  absl::StatusOr<TensorAssembler> a = TensorAssembler::Plan(&tensors, "rows");
  ASSERT_TRUE(a.ok()) << a.status();
  std::string staged(32, '.');
  ASSERT_TRUE(a->AssembleInto(staged.data() + 4).ok());
  auto piece = [](int64_t offset, const std::string& data) { return Piece(0, offset, data); };
  EXPECT_TRUE(a->Add(piece(0, std::string(10, 'a'))).ok());
  EXPECT_FALSE(a->Add(piece(12, "b")).ok());  // the same checks as into a buffer
  EXPECT_FALSE(a->Finish().ok());
  EXPECT_TRUE(a->Add(piece(10, std::string(14, 'c'))).ok());
  ASSERT_TRUE(a->Finish().ok());
  EXPECT_EQ(staged, "...." + std::string(10, 'a') + std::string(14, 'c') + "....");
  EXPECT_TRUE(tensors.Get(0).data().empty());

  // More than one tensor in pieces: refused.
  google::protobuf::RepeatedPtrField<v1::Tensor> two;
  for (int i = 0; i < 2; ++i) {
    v1::Tensor* t = two.Add();
    t->set_name("t");
    t->set_dtype(v1::F32);
    t->add_shape(1);
  }
  absl::StatusOr<TensorAssembler> b = TensorAssembler::Plan(&two, "rows");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->AssembleInto(staged.data()).code(), absl::StatusCode::kInvalidArgument);
}

// The end of a request stream: a whole message is whole however the
// stream ended, and `cancelled` (which on the server may wait up to a
// second for gRPC to report a cancel: server/transport/call_ended.h) is asked only
// when bytes are missing; then it decides CANCELLED or INVALID_ARGUMENT.
TEST(ReadChunkedPieces, CancelledIsAskedOnlyWhenBytesAreMissing) {
  auto plan = [](google::protobuf::RepeatedPtrField<v1::Tensor>* tensors) {
    v1::Tensor* t = tensors->Add();
    t->set_name("rows");
    t->set_dtype(v1::F32);
    t->add_shape(3);  // 12 bytes in pieces
    absl::StatusOr<TensorAssembler> a = TensorAssembler::Plan(tensors, "rows");
    EXPECT_TRUE(a.ok()) << a.status();
    a->AllocateBuffers([](size_t n) { return std::string(n, '\0'); });
    return *std::move(a);
  };
  auto reader = [](std::vector<std::string> parts) {
    return [parts = std::move(parts), at = size_t{0}](IncomingPart* in) mutable {
      if (at == parts.size()) return false;
      *in = Sliced(parts[at++], {});
      return true;
    };
  };
  v1::ScoreRequestPart a, b;
  a.mutable_piece()->set_data(std::string(8, 'a'));
  b.mutable_piece()->set_offset(8);
  b.mutable_piece()->set_data(std::string(4, 'b'));
  for (const bool client_cancelled : {false, true}) {
    int asked = 0;
    auto cancelled = [&] {
      ++asked;
      return client_cancelled;
    };
    google::protobuf::RepeatedPtrField<v1::Tensor> whole;
    TensorAssembler w = plan(&whole);
    EXPECT_TRUE(ReadChunkedPieces(reader({a.SerializeAsString(), b.SerializeAsString()}), cancelled, w).ok());
    EXPECT_EQ(whole.Get(0).data(), "aaaaaaaabbbb");
    EXPECT_EQ(asked, 0) << "a whole message must not wait for a cancellation";

    google::protobuf::RepeatedPtrField<v1::Tensor> cut;
    TensorAssembler c = plan(&cut);
    const absl::Status st = ReadChunkedPieces(reader({a.SerializeAsString()}), cancelled, c);
    EXPECT_EQ(asked, 1);
    EXPECT_EQ(st.code(), client_cancelled ? absl::StatusCode::kCancelled : absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("rows[0] \"rows\" at byte 8 of 12"), std::string::npos) << st;
  }
}

// A response's outputs are allocated only within the reader's limit: an
// answer announcing more (a broken or hostile server) is an error, found
// by fuzz_chunked; a well-formed one reassembles, later parts unread.
TEST(ReadChunkedResponse, AnnouncedBytesOverTheLimitAreRefusedAndAValidStreamReassembles) {
  auto reader = [](std::vector<std::string> parts) {
    return [parts = std::move(parts), at = size_t{0}](IncomingPart* in) mutable {
      if (at == parts.size()) return false;
      *in = Sliced(parts[at++], {});
      return true;
    };
  };
  v1::ScoreResponsePart first;
  v1::Tensor* out = first.mutable_response()->add_outputs();
  out->set_name("token_logprobs");
  out->set_dtype(v1::F32);
  out->add_shape(int64_t{1} << 40);  // 4 TiB announced
  absl::StatusOr<v1::ScoreResponse> r = ReadChunkedResponse(reader({first.SerializeAsString()}), int64_t{1} << 30);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("announces 4398046511104 bytes in pieces, over the reader's limit of 1073741824"),
            std::string::npos)
      << r.status();

  out->set_shape(0, 3);  // 12 bytes, in two pieces
  v1::ScoreResponsePart a, b;
  a.mutable_piece()->set_tensor(0);
  a.mutable_piece()->set_data(std::string(8, 'a'));
  b.mutable_piece()->set_tensor(0);
  b.mutable_piece()->set_offset(8);
  b.mutable_piece()->set_data(std::string(4, 'b'));
  r = ReadChunkedResponse(reader({first.SerializeAsString(), a.SerializeAsString(), b.SerializeAsString(), "junk"}),
                          12);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outputs(0).data(), "aaaaaaaabbbb");
  r = ReadChunkedResponse(reader({first.SerializeAsString(), a.SerializeAsString()}), 12);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(ReadChunkedResponse(reader({}), 12).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace logprob::chunked
