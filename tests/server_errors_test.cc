// Bad input through a live server: each error returns its status and a
// message naming the field and position, and the server keeps serving.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

class ServerErrors : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = ServerProcess::Start(2).release(); }
  static void TearDownTestSuite() { delete server_; }

  /// The basic_f32 request with `edit` applied, its status.
  grpc::Status ScoreEdited(const std::function<void(v1::ScoreRequest&)>& edit) {
    v1::ScoreRequest req = GoldenRequest(LoadGolden("basic_f32"));
    edit(req);
    auto stub = server_->NewStub();
    grpc::ClientContext ctx;
    v1::ScoreResponse resp;
    return stub->Score(&ctx, req, &resp);
  }
  static v1::Tensor* Input(v1::ScoreRequest& req, const std::string& name) {
    for (auto& t : *req.mutable_inputs())
      if (t.name() == name) return &t;
    return nullptr;
  }
  void TearDown() override {
    // The server still answers a good request after each bad one.
    ASSERT_TRUE(server_ && server_->Alive());
    EXPECT_TRUE(ScoreEdited([](v1::ScoreRequest&) {}).ok());
  }
  static ServerProcess* server_;
};
ServerProcess* ServerErrors::server_ = nullptr;

TEST_F(ServerErrors, TargetOutsideVocabNamesSequenceAndPosition) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) {
    int64_t bad = 5000;  // V = 1000; sequence 2, position 7
    std::memcpy(Input(r, "input_ids")->mutable_data()->data() + (2 * 64 + 7) * 8, &bad, 8);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("target 5000 of sequence 2 at position 7"), std::string::npos)
      << st.error_message();
}

TEST_F(ServerErrors, NegativeTargetOtherThanIgnoreIndex) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) {
    int64_t bad = -1;
    std::memcpy(Input(r, "input_ids")->mutable_data()->data() + (0 * 64 + 1) * 8, &bad, 8);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("sequence 0 at position 1"), std::string::npos) << st.error_message();
}

TEST_F(ServerErrors, ShapeMismatch) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) {
    auto* ids = Input(r, "input_ids");
    ids->set_shape(1, 32);
    ids->mutable_data()->resize(4 * 32 * 8);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("\"input_ids\": shape [4, 32] does not match"), std::string::npos)
      << st.error_message();
}

TEST_F(ServerErrors, DataSizeNotMatchingShape) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) { Input(r, "logits")->mutable_data()->resize(100); });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("\"logits\": data is 100 bytes"), std::string::npos) << st.error_message();
}

TEST_F(ServerErrors, WrongDtype) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) {
    auto* l = Input(r, "logits");
    l->set_dtype(v1::I32);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("\"logits\": dtype I32 is not F32, BF16 or F16"), std::string::npos)
      << st.error_message();
}

TEST_F(ServerErrors, UnknownTensor) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) {
    auto* t = r.add_inputs();
    t->set_name("attention_mask");
    t->set_dtype(v1::I64);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("unknown tensor \"attention_mask\""), std::string::npos) << st.error_message();
}

TEST_F(ServerErrors, GatherIdOutsideVocab) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) {
    int64_t bad = 1000;
    std::memcpy(Input(r, "gather_indices")->mutable_data()->data() + ((1 * 63 + 3) * 4 + 2) * 8, &bad, 8);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("id 1000 of sequence 1 at position 3"), std::string::npos) << st.error_message();
}

TEST_F(ServerErrors, BadOptions) {
  EXPECT_EQ(ScoreEdited([](v1::ScoreRequest& r) { r.mutable_options()->set_temperature(0.f); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ScoreEdited([](v1::ScoreRequest& r) { r.mutable_options()->set_topk(1001); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ScoreEdited([](v1::ScoreRequest& r) { r.mutable_options()->set_sampling_top_p(1.5f); }).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ServerErrors, HiddenStatesWithoutLmHead) {
  const auto st = ScoreEdited([](v1::ScoreRequest& r) {
    auto* l = Input(r, "logits");
    l->set_name("hidden_states");
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("lm_head"), std::string::npos) << st.error_message();
}

TEST_F(ServerErrors, StreamAnswersCarryIdsAndPerRequestErrors) {
  auto stub = server_->NewStub();
  grpc::ClientContext ctx;
  auto stream = stub->ScoreStream(&ctx);
  v1::ScoreRequest good = GoldenRequest(LoadGolden("packed_bf16"));
  v1::ScoreRequest bad = good;
  bad.set_id("bad");
  Input(bad, "cu_seqlens")->mutable_data()->replace(8, 8, std::string("\x50\0\0\0\0\0\0\0", 8));  // 80 > 72
  good.set_id("a");
  ASSERT_TRUE(stream->Write(good));
  ASSERT_TRUE(stream->Write(bad));
  good.set_id("b");
  ASSERT_TRUE(stream->Write(good));
  stream->WritesDone();
  std::map<std::string, v1::ScoreResponse> got;
  v1::ScoreResponse r;
  while (stream->Read(&r)) got[r.id()] = r;
  EXPECT_TRUE(stream->Finish().ok());
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got["a"].status_code(), 0);
  EXPECT_EQ(got["b"].status_code(), 0);
  EXPECT_EQ(got["a"].outputs(0).data(), got["b"].outputs(0).data());
  EXPECT_EQ(got["bad"].status_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(got["bad"].status_message().find("cu_seqlens"), std::string::npos) << got["bad"].status_message();
  const GoldenCase c = LoadGolden("packed_bf16");
  EXPECT_EQ(CompareOutputs(c.expected.tensors, {got["a"].outputs().begin(), got["a"].outputs().end()}), "");
}

/// Bytes that are no protobuf message: field 1, length-delimited, whose
/// length varint never ends.
grpc::ByteBuffer Garbage() {
  static const char kBytes[] = "\x0a\xff\xff\xff";
  grpc::Slice slice(kBytes, sizeof kBytes - 1);
  return grpc::ByteBuffer(&slice, 1);
}

// Malformed protobuf on a raw channel: every LogprobService method answers
// INVALID_ARGUMENT naming itself (gRPC's own deserialisation answered a
// unary call INTERNAL with an empty message, and ended a ScoreStream OK
// after the good messages before the bad one), and the server keeps
// serving.
TEST(MalformedProtobuf, EveryMethodAnswersInvalidArgumentNamingIt) {
  auto server = ServerProcess::Start(
      1, {"--lm-head", GoldenDir() + "/hidden_bf16.lm_head.safetensors", "--allow-lm-head-updates"});
  ASSERT_TRUE(server);
  auto channel = grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials());
  const std::string service = std::string("/") + v1::LogprobService::service_full_name() + "/";
  const std::vector<std::pair<std::string, std::string>> unary = {
      {"Score", "ScoreRequest"},
      {"GetServerInfo", "ServerInfoRequest"},
      {"RegisterSharedMemory", "RegisterSharedMemoryRequest"},
      {"UnregisterSharedMemory", "UnregisterSharedMemoryRequest"},
      {"ListSharedMemory", "ListSharedMemoryRequest"},
      {"ConfirmSharedMemory", "ConfirmSharedMemoryRequest"},
      {"BeginLmHeadUpdate", "BeginLmHeadUpdateRequest"},
      {"CommitLmHeadUpdate", "LmHeadUpdateRef"},
      {"AbortLmHeadUpdate", "LmHeadUpdateRef"},
  };
  for (const auto& [method, type] : unary) {
    SCOPED_TRACE(method);
    const std::string path = service + method;  // RpcMethod keeps the pointer
    const grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::ByteBuffer resp;
    const grpc::Status st = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel.get(), rpc, &ctx, Garbage(), &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_EQ(st.error_message(),
              method + ": the request is not a valid logprob.v1." + type + " message (protobuf parse failed)");
  }
  {  // The server-streaming ReadLmHeadRows: no answer, the same refusal.
    const std::string path = service + "ReadLmHeadRows";
    const grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::SERVER_STREAMING);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel.get(), rpc, &ctx, Garbage()));
    grpc::ByteBuffer got;
    EXPECT_FALSE(reader->Read(&got));
    const grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_EQ(st.error_message(),
              "ReadLmHeadRows: the request is not a valid logprob.v1.ReadLmHeadRowsRequest message (protobuf parse "
              "failed)");
  }
  // Streams: ScoreStream answers the good message, then ends naming the bad
  // one; the part-codec methods name their first part.
  const GoldenCase golden = LoadGolden("basic_f32");
  for (const std::string method : {"ScoreStream", "ScoreChunked", "PutLmHeadRows"}) {
    SCOPED_TRACE(method);
    const std::string path = service + method;
    const grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), rpc,
                                                                                              &ctx));
    const bool scores = method == "ScoreStream";
    if (scores) {
      grpc::ByteBuffer good;
      bool own = false;
      ASSERT_TRUE(grpc::SerializationTraits<v1::ScoreRequest>::Serialize(GoldenRequest(golden), &good, &own).ok());
      ASSERT_TRUE(stream->Write(good));
    }
    stream->Write(Garbage());
    stream->WritesDone();
    int answers = 0;
    grpc::ByteBuffer got;
    while (stream->Read(&got)) {
      ++answers;
      v1::ScoreResponse resp;
      ASSERT_TRUE(grpc::SerializationTraits<v1::ScoreResponse>::Deserialize(&got, &resp).ok());
      EXPECT_EQ(resp.status_code(), 0) << resp.status_message();
      EXPECT_EQ(CompareOutputs(golden.expected.tensors, {resp.outputs().begin(), resp.outputs().end()}), "");
    }
    const grpc::Status st = stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    if (scores) {
      EXPECT_EQ(answers, 1);
      EXPECT_EQ(st.error_message(),
                "ScoreStream: message 2 is not a valid logprob.v1.ScoreRequest message (protobuf parse failed)");
    } else {
      EXPECT_EQ(answers, 0);
      EXPECT_FALSE(st.error_message().empty());
    }
  }
  // Still serving.
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  EXPECT_TRUE(server->NewStub()->Score(&ctx, GoldenRequest(golden), &resp).ok());
}

// A head whose weights are finite but so large that its logits overflow
// float32 (every element the largest finite bf16, 0x7f7f = 3.39e38): a
// score is FAILED_PRECONDITION naming the head, its version and the first
// token, never NaN answered OK.
TEST(HiddenOverflow, LogitsThatOverflowFromFiniteInputsAreAnErrorNamingHeadVersionAndToken) {
  constexpr int64_t kV = 64, kH = 16;
  const std::string path = ::testing::TempDir() + "/huge_head." + std::to_string(getpid()) + ".safetensors";
  const std::vector<uint16_t> w(kV * kH, 0x7f7f);
  v1::Tensor t;
  t.set_name("lm_head.weight");
  t.set_dtype(v1::BF16);
  t.add_shape(kV);
  t.add_shape(kH);
  t.set_data(w.data(), w.size() * sizeof(uint16_t));
  ASSERT_TRUE(WriteSafetensors(path, {t}).ok());
  auto server = ServerProcess::Start(1, {"--lm-head", "huge=" + path, "--lm-head-version", "v7"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  const grpc::Status st = stub->Score(&ctx, RandomHiddenRequest(5, kH, kV, 3), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_NE(st.error_message().find("lm_head huge version v7: the logits of token [0] overflow float32"),
            std::string::npos)
      << st.error_message();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace logprob::testing
