// The queue's accounting through a live server, without timing: a unary
// Score reserves its bytes (announced in `logprob-request-bytes`, else
// max_request_bytes) before its body is read, so a Score call held open
// before sending its body holds them, the counted bytes
// (logprob_queued_bytes) reach --max-queue-bytes, and the next call is
// refused AT_CAPACITY without having sent a byte of its body. Once the
// held call is answered, the same request scores as before. A ScoreStream
// reserves its next message's bytes the same way before reading it.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/request_bytes.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int64_t kMaxQueue = int64_t{8} << 20, kMaxRequest = int64_t{6} << 20;

/// A Score call as a stream of raw messages: its metadata goes out when it
/// is made, its body only when Send is called.
class HeldScore {
 public:
  /// `announce` < 0: no logprob-request-bytes metadata.
  HeldScore(const std::shared_ptr<grpc::Channel>& channel, int64_t announce, const std::string& announce_text = "")
      : method_(Path().c_str(), grpc::internal::RpcMethod::BIDI_STREAMING) {
    if (!announce_text.empty()) {
      ctx_.AddMetadata(kRequestBytesMetadataKey, announce_text);
    } else if (announce >= 0) {
      ctx_.AddMetadata(kRequestBytesMetadataKey, std::to_string(announce));
    }
    ctx_.set_deadline(std::chrono::system_clock::now() + kWaitTimeout);
    stream_.reset(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
        channel.get(), method_, &ctx_));
  }
  /// Sends `request` as the body, then reads the answer and the status.
  grpc::Status Send(const v1::ScoreRequest& request, v1::ScoreResponse* response) {
    grpc::ByteBuffer body;
    bool own = false;
    EXPECT_TRUE(grpc::SerializationTraits<v1::ScoreRequest>::Serialize(request, &body, &own).ok());
    stream_->Write(body);
    stream_->WritesDone();
    grpc::ByteBuffer reply;
    if (stream_->Read(&reply)) {
      EXPECT_TRUE(grpc::SerializationTraits<v1::ScoreResponse>::Deserialize(&reply, response).ok());
    }
    return stream_->Finish();
  }
  /// The status, without sending a body (the server answers first).
  grpc::Status StatusWithoutBody() { return stream_->Finish(); }

 private:
  static const std::string& Path() {
    static const std::string path = std::string("/") + v1::LogprobService::service_full_name() + "/Score";
    return path;
  }
  const grpc::internal::RpcMethod method_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
};

/// A server with two workers, an 8 MiB queue and 6 MiB requests, its
/// metrics on `metrics_port`.
std::unique_ptr<ServerProcess> StartLimited(int metrics_port) {
  return ServerProcess::Start(
      2, {"--max-queue-bytes", std::to_string(kMaxQueue), "--max-request-bytes", std::to_string(kMaxRequest),
          "--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port)});
}

TEST(ServerAdmission, BytesAreCountedBeforeTheBodyArrivesAndTheNextCallIsRefusedWithoutIt) {
  const int metrics_port = FreePort();
  auto server = StartLimited(metrics_port);
  ASSERT_TRUE(server);
  auto channel = grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials());
  const GoldenCase golden = LoadGolden("basic_f32");
  const v1::ScoreRequest request = GoldenRequest(golden);
  // Every answer: the golden outputs (float64 references), bit for bit the same.
  const auto expect_golden = [&golden](const v1::ScoreResponse& r) {
    return CompareOutputs(golden.expected.tensors, {r.outputs().begin(), r.outputs().end()});
  };
  const int64_t size = static_cast<int64_t>(request.ByteSizeLong());
  ASSERT_LT(size, kMaxQueue - kMaxRequest) << "the golden request is small";
  // The reference: the same request, unary, with nothing else in flight.
  v1::ScoreResponse reference;
  {
    auto stub = server->NewStub();
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Score(&ctx, request, &reference).ok());
    ASSERT_EQ(expect_golden(reference), "");
  }

  // Held before its body: 6 MiB of the 8 MiB counted, one request in flight.
  HeldScore held(channel, kMaxRequest);
  ASSERT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", static_cast<double>(kMaxRequest)));
  ASSERT_TRUE(WaitForMetric(metrics_port, "logprob_inflight_requests", 1));
  // An announced 3 MiB and an unannounced call (max_request_bytes) do not
  // fit: refused before a byte of their bodies is sent.
  for (const int64_t announce : {int64_t{3} << 20, int64_t{-1}}) {
    HeldScore next(channel, announce);
    const grpc::Status st = next.StatusWithoutBody();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << announce << ": " << st.error_message();
    EXPECT_NE(st.error_message().find("--max-queue-bytes"), std::string::npos) << st.error_message();
  }
  // What fits beside it is admitted: the golden request, announced exactly.
  {
    HeldScore small(channel, size);
    v1::ScoreResponse response;
    const grpc::Status st = small.Send(request, &response);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(expect_golden(response), "");
    EXPECT_EQ(response.outputs(0).data(), reference.outputs(0).data());
  }
  EXPECT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", static_cast<double>(kMaxRequest)));

  // The held call's body (smaller than announced: counted at its size) is
  // scored like any other; then nothing is counted.
  v1::ScoreResponse held_response;
  const grpc::Status held_status = held.Send(request, &held_response);
  ASSERT_TRUE(held_status.ok()) << held_status.error_message();
  EXPECT_EQ(expect_golden(held_response), "");
  EXPECT_EQ(held_response.outputs(0).data(), reference.outputs(0).data());
  EXPECT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", 0));
  EXPECT_TRUE(WaitForMetric(metrics_port, "logprob_inflight_requests", 0));

  // An announcement is held to: a body larger than announced, a size that
  // is not one, or one over max_request_bytes is refused, naming the key.
  {
    HeldScore liar(channel, size - 1);
    v1::ScoreResponse response;
    const grpc::Status st = liar.Send(request, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find(kRequestBytesMetadataKey), std::string::npos) << st.error_message();
  }
  for (const std::string& text : {std::string("12abc"), std::string("-5"), std::to_string(kMaxRequest + 1)}) {
    HeldScore bad(channel, -1, text);
    const grpc::Status st = bad.StatusWithoutBody();
    EXPECT_NE(st.error_code(), grpc::StatusCode::OK) << text;
    EXPECT_NE(st.error_message().find(kRequestBytesMetadataKey), std::string::npos)
        << text << ": " << st.error_message();
  }
  EXPECT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", 0));
}

/// A ScoreStream call whose metadata announces `announce` bytes (< 0: none).
struct OpenStream {
  OpenStream(v1::LogprobService::Stub* stub, int64_t announce) {
    if (announce >= 0) ctx.AddMetadata(kRequestBytesMetadataKey, std::to_string(announce));
    ctx.set_deadline(std::chrono::system_clock::now() + kWaitTimeout);
    stream = stub->ScoreStream(&ctx);
  }
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ScoreRequest, v1::ScoreResponse>> stream;
};

TEST(ServerAdmission, AStreamsNextMessageIsCountedBeforeItIsRead) {
  const int metrics_port = FreePort();
  auto server = StartLimited(metrics_port);
  ASSERT_TRUE(server);
  auto channel = grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials());
  auto stub = server->NewStub();
  const GoldenCase golden = LoadGolden("basic_f32");
  const v1::ScoreRequest request = GoldenRequest(golden);
  const int64_t size = static_cast<int64_t>(request.ByteSizeLong());

  // A stream announcing 6 MiB messages holds 6 MiB of the 8 MiB before it
  // sends a byte: an announced 3 MiB Score is refused without its body.
  OpenStream open(stub.get(), kMaxRequest);
  ASSERT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", static_cast<double>(kMaxRequest)));
  {
    HeldScore next(channel, int64_t{3} << 20);
    const grpc::Status st = next.StatusWithoutBody();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  }
  // An idle stream without room for its first message is refused
  // RESOURCE_EXHAUSTED (after a short wait for room), reading nothing.
  {
    OpenStream crowded(stub.get(), kMaxRequest);
    v1::ScoreResponse response;
    EXPECT_FALSE(crowded.stream->Read(&response));
    const grpc::Status st = crowded.stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_NE(st.error_message().find("--max-queue-bytes"), std::string::npos) << st.error_message();
  }
  // Its messages are scored as usual, and the next one is reserved again.
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(open.stream->Write(request));
    v1::ScoreResponse response;
    ASSERT_TRUE(open.stream->Read(&response));
    EXPECT_EQ(response.status_code(), 0) << response.status_message();
    EXPECT_EQ(CompareOutputs(golden.expected.tensors, {response.outputs().begin(), response.outputs().end()}), "");
    ASSERT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", static_cast<double>(kMaxRequest)));
  }
  open.stream->WritesDone();
  const grpc::Status done = open.stream->Finish();
  EXPECT_TRUE(done.ok()) << done.error_message();
  EXPECT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", 0));

  // A message over the stream's announcement ends it INVALID_ARGUMENT,
  // naming the key.
  {
    OpenStream liar(stub.get(), size - 1);
    ASSERT_TRUE(liar.stream->Write(request));
    liar.stream->WritesDone();
    v1::ScoreResponse response;
    EXPECT_FALSE(liar.stream->Read(&response));
    const grpc::Status st = liar.stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find(kRequestBytesMetadataKey), std::string::npos) << st.error_message();
  }
  // Unannounced: max_request_bytes is held for each read.
  {
    OpenStream plain(stub.get(), -1);
    ASSERT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", static_cast<double>(kMaxRequest)));
    ASSERT_TRUE(plain.stream->Write(request));
    v1::ScoreResponse response;
    ASSERT_TRUE(plain.stream->Read(&response));
    EXPECT_EQ(CompareOutputs(golden.expected.tensors, {response.outputs().begin(), response.outputs().end()}), "");
    plain.stream->WritesDone();
    EXPECT_TRUE(plain.stream->Finish().ok());
  }
  EXPECT_TRUE(WaitForMetric(metrics_port, "logprob_queued_bytes", 0));
}

/// Threads of process `pid` (/proc/PID/task).
int Threads(pid_t pid) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task")) {
    (void)e;
    ++n;
  }
  return n;
}

// PutLmHeadRows calls that never send their first part each hold a server
// thread: 16 may wait, the others are refused at once, and the waiting
// ones are cancelled after --lm-head-update-timeout, leaving no thread.
TEST(ServerAdmission, SilentUpdateStreamsAreCappedAndTimedOutLeavingNoThread) {
  const std::string head = ::testing::TempDir() + "/silent_puts." + std::to_string(getpid()) + ".safetensors";
  ASSERT_TRUE(WriteRandomLmHead(head, 64, 16, 3).ok());
  auto server =
      ServerProcess::Start(1, {"--lm-head", head, "--allow-lm-head-updates", "--lm-head-update-timeout", "2s"});
  ASSERT_TRUE(server);
  const int idle = Threads(server->pid());
  const std::string path = std::string("/") + v1::LogprobService::service_full_name() + "/PutLmHeadRows";
  const grpc::internal::RpcMethod method(path.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
  constexpr int kCalls = 50;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>> calls;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("logprob.silent", i);  // a connection of its own
    channels.push_back(grpc::CreateCustomChannel(server->address(), grpc::InsecureChannelCredentials(), args));
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + kWaitTimeout);
    calls.emplace_back(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
        channels.back().get(), method, contexts.back().get()));
  }
  // Every call ends without having sent a byte: refused, or cancelled.
  int refused = 0, timed_out = 0;
  for (auto& call : calls) {
    const grpc::Status st = call->Finish();
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      EXPECT_NE(st.error_message().find("waiting for their first message"), std::string::npos) << st.error_message();
    } else {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
      ++timed_out;
    }
  }
  EXPECT_EQ(refused, kCalls - 16);
  EXPECT_EQ(timed_out, 16);
  calls.clear();
  // The threads that served them are gone (gRPC keeps a couple of idle
  // pollers: the count returns to what the idle server had, give or take 2).
  int now = 0;
  EXPECT_TRUE(WaitUntil("the server's threads back to its idle count",
                        [&] {
                          now = Threads(server->pid());
                          return now <= idle + 2;
                        }))
      << "idle " << idle << ", now " << now;
  // And updates still work: the server answers a put's Begin.
  auto stub = server->NewStub();
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  EXPECT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  std::filesystem::remove(head);
}

}  // namespace
}  // namespace logprob::testing
