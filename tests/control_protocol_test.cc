// The worker protocol version of the control plane (common/worker_protocol.h):
// a ControlService refuses a Join of another version, or of another build
// (common/version.h BuildId), with FAILED_PRECONDITION naming both and
// accepts its own; a logprob-worker refused by a front-end of another
// release or build, or answered by one that does not send its version, logs
// why and exits with status 1
// instead of retrying (it runs with --rejoin, the default).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "common/worker_protocol.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "server/pool/control_service.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

using internal::v1::JoinReply;
using internal::v1::JoinRequest;

/// A gRPC server on 127.0.0.1 (free port) serving `service`.
class InProcessServer {
 public:
  explicit InProcessServer(grpc::Service* service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
  }
  ~InProcessServer() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  bool ok() const { return server_ && port_ > 0; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

/// Joins `address` with `version`; returns the stream's status when it
/// ended without a reply, or OK with *reply set (the call is then
/// cancelled: the member leaves).
grpc::Status Join(const std::string& address, uint32_t version, JoinReply* reply,
                  const std::string& build = BuildId()) {
  auto stub = internal::v1::Control::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  JoinRequest req;
  req.set_pid(1234);
  req.set_hostname("test-host");
  req.set_protocol_version(version);
  req.set_build(build);
  auto stream = stub->Join(&ctx, req);
  if (stream->Read(reply)) {
    ctx.TryCancel();
    stream->Finish();
    return grpc::Status::OK;
  }
  return stream->Finish();
}

TEST(ControlProtocol, AJoinOfAnotherVersionIsRefusedNamingBothVersions) {
  ControlService control(1);
  InProcessServer server(&control);
  ASSERT_TRUE(server.ok());
  for (const uint32_t other : {kWorkerProtocolVersion + 1, 0u}) {
    SCOPED_TRACE(other);
    JoinReply reply;
    const grpc::Status st = Join(server.address(), other, &reply);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_NE(st.error_message().find(absl::StrCat("worker protocol version ", other, " ")), std::string::npos)
        << st.error_message();
    EXPECT_NE(st.error_message().find(absl::StrCat("front-end's version ", kWorkerProtocolVersion)), std::string::npos)
        << st.error_message();
  }
  // The refused joins took no place in the pool: a worker of this release
  // gets rank 0 of 1, and the front-end's version with it.
  JoinReply reply;
  const grpc::Status st = Join(server.address(), kWorkerProtocolVersion, &reply);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(reply.rank(), 0);
  EXPECT_EQ(reply.world_size(), 1);
  EXPECT_EQ(reply.protocol_version(), kWorkerProtocolVersion);
  EXPECT_EQ(reply.build(), BuildId());
  control.Shutdown();
}

TEST(ControlProtocol, AJoinOfAnotherBuildIsRefusedNamingBothBuilds) {
  ControlService control(1);
  InProcessServer server(&control);
  ASSERT_TRUE(server.ok());
  const std::string other = "0.0.0 (commit 000000000000, CUDA no)";
  JoinReply reply;
  const grpc::Status st = Join(server.address(), kWorkerProtocolVersion, &reply, other);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_NE(st.error_message().find(BuildMismatch(other, BuildId())), std::string::npos) << st.error_message();
  ASSERT_TRUE(Join(server.address(), kWorkerProtocolVersion, &reply).ok());
  EXPECT_EQ(reply.rank(), 0);
  control.Shutdown();
}

/// Runs logprob-worker against `frontend` (with --rejoin, the default) for
/// at most 60 s: a worker that retried instead of exiting ends with 124.
CommandResult RunWorker(const std::string& frontend) {
  return RunCommand(absl::StrCat("timeout 60 ", BinDir(), "/logprob-worker --frontend ", frontend));
}

TEST(ControlProtocol, AWorkerRefusedByAFrontEndOfAnotherReleaseExits) {
  const uint32_t theirs = kWorkerProtocolVersion + 1;
  ControlService control(1, {}, {}, {}, theirs);
  InProcessServer server(&control);
  ASSERT_TRUE(server.ok());
  const CommandResult r = RunWorker(server.address());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("refused"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(ProtocolMismatch(kWorkerProtocolVersion, theirs)), std::string::npos) << r.output;
  control.Shutdown();
}

TEST(ControlProtocol, AWorkerRefusedByAFrontEndOfAnotherBuildExits) {
  const std::string theirs = "0.0.0 (commit 000000000000, CUDA no)";
  ControlService control(1, {}, {}, {}, kWorkerProtocolVersion, InternalAuth::Insecure(), theirs);
  InProcessServer server(&control);
  ASSERT_TRUE(server.ok());
  const CommandResult r = RunWorker(server.address());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find(BuildMismatch(BuildId(), theirs)), std::string::npos) << r.output;
  control.Shutdown();
}

/// A front-end of a release from before versioning: answers every join
/// with rank 0 of 1 and no protocol_version. (It then ends the stream,
/// which a worker would take for the end of its membership and join again;
/// it checks the version before it watches the stream.)
class UnversionedControl final : public internal::v1::Control::Service {
 public:
  grpc::Status Join(grpc::ServerContext*, const JoinRequest*, grpc::ServerWriter<JoinReply>* writer) override {
    JoinReply reply;
    reply.set_rank(0);
    reply.set_world_size(1);
    reply.set_comm("gloo");
    reply.set_backend("cpu");
    reply.set_store_prefix("gen0/");
    writer->Write(reply);
    return grpc::Status::OK;
  }
};

TEST(ControlProtocol, AWorkerAnsweredByAnUnversionedFrontEndExits) {
  UnversionedControl control;
  InProcessServer server(&control);
  ASSERT_TRUE(server.ok());
  const CommandResult r = RunWorker(server.address());
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find(ProtocolMismatch(kWorkerProtocolVersion, 0)), std::string::npos) << r.output;
}

}  // namespace
}  // namespace logprob::testing
