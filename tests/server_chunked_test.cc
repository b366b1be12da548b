// ScoreChunked end to end against a live 2-worker server (with the golden
// lm_head): every golden case gives byte-identical answers in pieces and in
// one Score message; large outputs come back in pieces; bad piece streams
// (early end, out of order, past the announced size, over
// --max-request-bytes, cancelled) each get a clear status and the server
// keeps serving; a 300 MB request scores through logprob-client with the
// default limits.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <random>

#include "client/chunked_call.h"
#include "common/chunk_codec.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

using Stream = grpc::ClientReaderWriter<chunked::OutgoingPart, chunked::IncomingPart>;

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT_MAX);
  args.SetMaxSendMessageSize(INT_MAX);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

/// A raw ScoreChunked call, for sending hand-made part sequences.
struct RawCall {
  explicit RawCall(const std::shared_ptr<grpc::Channel>& channel)
      : method("/logprob.v1.LogprobService/ScoreChunked", grpc::internal::RpcMethod::BIDI_STREAMING, channel) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    stream.reset(grpc::internal::ClientReaderWriterFactory<chunked::OutgoingPart, chunked::IncomingPart>::Create(
        channel.get(), method, &context));
  }
  /// Sends the request part: `req` with the data of inputs `pieced` removed.
  bool SendHeader(v1::ScoreRequest req, const std::vector<int>& pieced) {
    for (int i : pieced) req.mutable_inputs(i)->clear_data();
    *first.mutable_request() = std::move(req);
    chunked::OutgoingPart p;
    p.message = &first;
    return stream->Write(p);
  }
  bool SendPiece(int tensor, int64_t offset, std::string_view bytes) {
    chunked::OutgoingPart p;
    p.tensor = tensor;
    p.offset = offset;
    p.bytes = bytes;
    return stream->Write(p);
  }
  /// Half-closes, drains the answer and returns the call's status.
  grpc::Status Finish() {
    stream->WritesDone();
    chunked::IncomingPart in;
    while (stream->Read(&in)) {
    }
    return stream->Finish();
  }
  grpc::ClientContext context;
  grpc::internal::RpcMethod method;
  std::unique_ptr<Stream> stream;
  v1::ScoreRequestPart first;
};

class ScoreChunked : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    metrics_port_ = FreePort();
    server_ = ServerProcess::Start(2, {"--lm-head", GoldenDir() + "/hidden_bf16.lm_head.safetensors",
                                       "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port_)})
                  .release();
  }
  static void TearDownTestSuite() { delete server_; }

  /// The golden case `name` scores in pieces exactly as in one message and
  /// matches its expected outputs.
  static void ExpectGoldenPasses(const std::string& name) {
    SCOPED_TRACE(name);
    const GoldenCase c = LoadGolden(name);
    auto r = client::ScoreChunked(Channel(server_->address()), GoldenRequest(c), 1000, 120, -1);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<v1::Tensor> got(r->outputs().begin(), r->outputs().end());
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got), "");
  }

  static ServerProcess* server_;
  static int metrics_port_;
};
ServerProcess* ScoreChunked::server_ = nullptr;
int ScoreChunked::metrics_port_ = 0;

TEST_F(ScoreChunked, EveryGoldenCaseIsByteIdenticalToOneMessage) {
  ASSERT_TRUE(server_);
  std::vector<std::string> names = LogitsGoldenNames();
  names.push_back("hidden_bf16");
  auto stub = server_->NewStub();
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const GoldenCase c = LoadGolden(name);
    v1::ScoreResponse one;
    const grpc::Status st = ScoreGolden(*stub, c, &one);
    // Every tensor in pieces (inline_bytes -1), pieces of an odd size: the
    // same answer, or the same error, as one message.
    for (int64_t piece : {int64_t{1000}, int64_t{65536}, chunked::kDefaultPieceBytes}) {
      auto chunked = client::ScoreChunked(Channel(server_->address()), GoldenRequest(c), piece, 120, -1);
      EXPECT_EQ(chunked.status(), FromGrpc(st)) << "piece_bytes " << piece;
      if (chunked.ok()) {
        EXPECT_EQ(chunked->SerializeAsString(), one.SerializeAsString()) << "piece_bytes " << piece;
      }
    }
    ASSERT_TRUE(st.ok()) << st.error_message();
    const std::vector<v1::Tensor> got(one.outputs().begin(), one.outputs().end());
    EXPECT_EQ(CompareOutputs(c.expected.tensors, got), "");
  }
}

TEST_F(ScoreChunked, LargeOutputsComeBackInPiecesIdenticalToOneMessage) {
  ASSERT_TRUE(server_);
  // top-1024 of 2048 rows: 24 MiB of outputs, over the 2 MiB answer piece.
  v1::ScoreRequest req = RandomPackedRequest("logits", 2048, 2048, 2048, 7);
  req.set_id("large-outputs");
  req.mutable_options()->set_topk(1024);
  auto stub = server_->NewStub();
  grpc::ClientContext ctx;
  v1::ScoreResponse one;
  const grpc::Status st = stub->Score(&ctx, req, &one);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_GT(one.ByteSizeLong(), 4u * chunked::kDefaultPieceBytes);
  auto chunked = client::ScoreChunked(Channel(server_->address()), req, chunked::kDefaultPieceBytes, 120);
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  EXPECT_EQ(chunked->SerializeAsString(), one.SerializeAsString());
}

/// A golden request and its logits' bytes, for the error cases.
struct BadStreamCase {
  v1::ScoreRequest req = GoldenRequest(LoadGolden("basic_f32"));
  std::string logits = req.inputs(0).data();
};

TEST_F(ScoreChunked, BadPieceStreamsGetClearErrorsAndTheServerKeepsServing) {
  ASSERT_TRUE(server_);
  const auto channel = Channel(server_->address());
  BadStreamCase c;
  ASSERT_EQ(c.req.inputs(0).name(), "logits");
  const int64_t n = static_cast<int64_t>(c.logits.size());
  const std::string_view all(c.logits);
  struct Case {
    const char* what;
    std::function<void(RawCall&)> send;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"stops midway", [&](RawCall& call) { call.SendPiece(0, 0, all.substr(0, 4096)); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "the stream ended before all pieces arrived: inputs[0] \"logits\" at byte 4096 of " + std::to_string(n)},
      {"out of order",
       [&](RawCall& call) {
         call.SendPiece(0, 0, all.substr(0, 4096));
         call.SendPiece(0, 8192, all.substr(8192, 4096));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "piece for inputs[0] \"logits\" at offset 8192: expected offset 4096"},
      {"past the announced size",
       [&](RawCall& call) {
         call.SendPiece(0, 0, all);
         call.SendPiece(0, n, all.substr(0, 4));
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "piece for inputs[0] \"logits\" at offset " + std::to_string(n) +
           " with 4 bytes ends past the tensor's announced " + std::to_string(n) + " bytes"},
      {"unknown tensor", [&](RawCall& call) { call.SendPiece(9, 0, all.substr(0, 16)); },
       grpc::StatusCode::INVALID_ARGUMENT, "piece at offset 0 names tensor 9 but inputs has"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    RawCall call(channel);
    ASSERT_TRUE(call.SendHeader(c.req, {0}));
    k.send(call);
    const grpc::Status st = call.Finish();
    EXPECT_EQ(st.error_code(), k.code) << st.error_message();
    EXPECT_NE(st.error_message().find(k.message), std::string::npos) << st.error_message();
  }
  {
    SCOPED_TRACE("first part is a piece");
    RawCall call(channel);
    ASSERT_TRUE(call.SendPiece(0, 0, all.substr(0, 16)));
    const grpc::Status st = call.Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("must carry the request"), std::string::npos) << st.error_message();
  }
  {
    SCOPED_TRACE("client cancels midway");
    RawCall call(channel);
    ASSERT_TRUE(call.SendHeader(c.req, {0}));
    ASSERT_TRUE(call.SendPiece(0, 0, all.substr(0, 4096)));
    call.context.TryCancel();
    EXPECT_EQ(call.Finish().error_code(), grpc::StatusCode::CANCELLED);
    // The server sees the cancellation, answers CANCELLED and releases the
    // request's admission.
    ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_requests_total{code=\"CANCELLED\",method=\"ScoreChunked\"}", 1));
  }
  ASSERT_TRUE(WaitForMetric(metrics_port_, "logprob_inflight_requests", 0));
  EXPECT_EQ(MetricSample(ScrapeMetrics(metrics_port_).output,
                         "logprob_requests_total{code=\"INVALID_ARGUMENT\",method=\"ScoreChunked\"}"),
            5);
  ExpectGoldenPasses("basic_f32");
  ExpectGoldenPasses("hidden_bf16");
}

TEST(ScoreChunkedLimits, ARequestOverMaxRequestBytesIsRefusedUpFront) {
  auto server = ServerProcess::Start(1, {"--max-request-bytes", "800000"});
  ASSERT_TRUE(server);
  const GoldenCase c = LoadGolden("basic_f32");  // 1 MiB of logits
  auto r = client::ScoreChunked(Channel(server->address()), GoldenRequest(c), 65536, 60);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("over the server's max_request_bytes 800000"), std::string::npos) << r.status();
  // Still serving: a case under the limit passes.
  const GoldenCase small = LoadGolden("sampling_f32");
  auto ok = client::ScoreChunked(Channel(server->address()), GoldenRequest(small), 65536, 60, -1);
  ASSERT_TRUE(ok.ok()) << ok.status();
  const std::vector<v1::Tensor> got(ok->outputs().begin(), ok->outputs().end());
  EXPECT_EQ(CompareOutputs(small.expected.tensors, got), "");
}

/// logits [T, V] bf16 whose rows are all the same random row, so each
/// target's logprob is known in float64: x[t] - logsumexp(x).
TEST_F(ScoreChunked, A300MBRequestScoresThroughTheCliWithDefaultLimits) {
  ASSERT_TRUE(server_);
  constexpr int64_t V = 32000, T = 4800;  // 307 MB of bf16 logits
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::vector<uint16_t> row(V);
  std::vector<double> x(V);
  for (int64_t v = 0; v < V; ++v) {
    row[v] = FloatToBf16(normal(rng));
    x[v] = Bf16ToFloat(row[v]);
  }
  double m = x[0], sum = 0;
  for (double a : x) m = std::max(m, a);
  for (double a : x) sum += std::exp(a - m);
  const double lse = m + std::log(sum);
  v1::Tensor logits, ids, cu;
  logits.set_name("logits");
  logits.set_dtype(v1::BF16);
  logits.add_shape(T);
  logits.add_shape(V);
  std::string* data = logits.mutable_data();
  data->resize(static_cast<size_t>(T * V * 2));
  for (int64_t t = 0; t < T; ++t) std::memcpy(data->data() + t * V * 2, row.data(), V * 2);
  ids.set_name("input_ids");
  ids.set_dtype(v1::I64);
  ids.add_shape(T);
  std::vector<int64_t> targets(T);
  for (int64_t t = 0; t < T; ++t) targets[t] = static_cast<int64_t>(rng() % V);
  ids.set_data(std::string(reinterpret_cast<const char*>(targets.data()), T * 8));
  cu.set_name("cu_seqlens");
  cu.set_dtype(v1::I64);
  cu.add_shape(2);
  const int64_t bounds[2] = {0, T};
  cu.set_data(std::string(reinterpret_cast<const char*>(bounds), 16));
  const std::string in = ::testing::TempDir() + "/chunked_300mb." + std::to_string(getpid()) + ".safetensors";
  const std::string out = in + ".out.safetensors";
  ASSERT_TRUE(WriteSafetensors(in, {logits, ids, cu}).ok());
  logits.Clear();
  const CommandResult r = RunCommand(BinDir() + "/logprob-client score --server " + server_->address() + " --input " +
                                     in + " --output " + out);
  std::remove(in.c_str());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.find(" requests"), std::string::npos) << r.output;  // one request, not split
  auto got = ReadSafetensors(out);
  std::remove(out.c_str());
  ASSERT_TRUE(got.ok()) << got.status();
  const v1::Tensor* lp = got->Find("token_logprobs");
  ASSERT_NE(lp, nullptr);
  const std::vector<float> values = Floats(*lp);
  ASSERT_EQ(values.size(), static_cast<size_t>(T - 1));
  for (int64_t t = 0; t + 1 < T; ++t) {
    const double want = x[targets[t + 1]] - lse;
    ASSERT_NEAR(values[t], want, 2e-4 + 2e-5 * std::abs(want)) << "row " << t;
  }
  ExpectGoldenPasses("basic_f32");
}

}  // namespace
}  // namespace logprob::testing
