// The internal plane's pieces (docs/security.md "The internal plane"):
// the pool secret (made, read from a private file or an inherited
// descriptor, never echoed), the check every method of every internal
// service runs first (looped over the services the proto declares, served
// in-process: without the secret, with a wrong one, with the right one),
// and what a worker and the control service no longer take from the wire:
// items of another generation, shared-memory names that are not the
// front-end's payload regions, top-k beyond the vocabulary, rendezvous
// keys of another generation or beyond the store's limits, lm_head rows
// for a non-member or a tensor larger than its file.
#include "common/internal_auth.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/metadata_channel.h"
#include "common/pool_secret.h"
#include "common/shared_memory.h"
#include "common/worker_protocol.h"
#include "google/protobuf/descriptor.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "server/pool/control_service.h"
#include "tests/generic_call.h"
#include "tests/test_support.h"
#include "worker/backend_factory.h"
#include "worker/comm/communicator.h"
#include "worker/heads/lm_head_registry.h"
#include "worker/scoring/payload_regions.h"
#include "worker/worker_service.h"

namespace logprob::testing {
namespace {

namespace iv1 = internal::v1;

std::string WriteFile(const std::string& name, const std::string& text, mode_t mode) {
  const std::string path = ::testing::TempDir() + "/" + name + "." + std::to_string(getpid());
  std::remove(path.c_str());
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, mode);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  close(fd);
  chmod(path.c_str(), mode);
  return path;
}

TEST(PoolSecret, GeneratedSecretsAre64HexDigitsAndDiffer) {
  const PoolSecret a = PoolSecret::Generate(), b = PoolSecret::Generate();
  EXPECT_EQ(a.value().size(), 64u);
  EXPECT_EQ(a.value().find_first_not_of("0123456789abcdef"), std::string::npos) << a.value();
  EXPECT_NE(a.value(), b.value());
}

TEST(PoolSecret, AFileIsReadTrimmedOnlyWhenOtherUsersCannotReadItAndIsNeverEchoed) {
  const std::string secret = "s3cret-of-the-pool-0123456789";
  auto ok = PoolSecret::FromFile(WriteFile("private_secret", "  " + secret + "\n", 0600));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->value(), secret);
  auto readable = PoolSecret::FromFile(WriteFile("readable_secret", secret, 0644));
  EXPECT_EQ(readable.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(readable.status().message().find("other users can read it (mode 0644)"), std::string::npos)
      << readable.status();
  auto short_one = PoolSecret::FromFile(WriteFile("short_secret", "tooshort", 0600));
  EXPECT_EQ(short_one.status().code(), absl::StatusCode::kInvalidArgument);
  auto spaced = PoolSecret::FromFile(WriteFile("spaced_secret", "a secret with spaces inside", 0600));
  EXPECT_EQ(spaced.status().code(), absl::StatusCode::kInvalidArgument);
  for (const auto& st : {readable.status(), short_one.status(), spaced.status()}) {
    EXPECT_EQ(st.message().find(secret), std::string::npos) << st;
    EXPECT_EQ(st.message().find("tooshort"), std::string::npos) << st;
  }
  EXPECT_FALSE(PoolSecret::FromFile(::testing::TempDir() + "/no_such_secret").ok());
  // A FIFO is refused at once (nobody writes it: opening it must not wait).
  const std::string fifo = ::testing::TempDir() + "/secret_fifo." + std::to_string(getpid());
  std::remove(fifo.c_str());
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const auto from_fifo = PoolSecret::FromFile(fifo);
  EXPECT_EQ(from_fifo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(from_fifo.status().message().find("not a regular file"), std::string::npos) << from_fifo.status();
  std::remove(fifo.c_str());
}

TEST(PoolSecret, AnInheritableDescriptorCarriesTheSecretAndIsSealed) {
  const PoolSecret secret = PoolSecret::Generate();
  auto fd = secret.ToInheritableFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_NE(fcntl(*fd, F_GETFD) & FD_CLOEXEC, 0);  // only the launcher's dup2 copy is inherited
  EXPECT_LT(write(*fd, "x", 1), 0);                // sealed: nobody rewrites it for the siblings
  auto read = PoolSecret::FromFd(*fd);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->value(), secret.value());
  close(*fd);
}

/// A gRPC server on 127.0.0.1 (free port) serving `services`.
class InProcessServer {
 public:
  explicit InProcessServer(std::vector<grpc::Service*> services) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    for (auto* s : services) builder.RegisterService(s);
    server_ = builder.BuildAndStart();
  }
  ~InProcessServer() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  bool ok() const { return server_ && port_ > 0; }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

/// One call of `path` with the default request.
grpc::Status Call(const std::shared_ptr<grpc::Channel>& channel, const std::string& path) {
  return GenericUnaryCall(channel, path, "", std::chrono::seconds(3));
}

/// A CPU WorkerService of one rank with `admission`.
std::unique_ptr<WorkerService> CpuWorker(WorkerAdmission admission) {
  auto backend = MakeBackend(BackendConfig{});
  EXPECT_TRUE(backend.ok()) << backend.status();
  auto lm_heads = std::make_unique<LmHeadRegistry>(**backend, LmHeadPrecision::kAuto, 0, 1);
  return std::make_unique<WorkerService>(std::make_unique<SelfCommunicator>(), std::move(*backend), std::move(lm_heads),
                                         kDefaultHiddenChunkTokens, std::move(admission));
}

/// A token-parallel item of one row of f32 `logits` whose target is `target`.
iv1::WorkItem TokenItem(const std::vector<float>& logits, int64_t target) {
  iv1::WorkItem item;
  item.set_layout(iv1::TOKEN_PARALLEL);
  item.set_dtype(v1::F32);
  item.set_num_rows(1);
  item.set_vocab_size(static_cast<int64_t>(logits.size()));
  item.set_vocab_end(static_cast<int64_t>(logits.size()));
  item.add_targets(target);
  item.set_data(std::string(reinterpret_cast<const char*>(logits.data()), logits.size() * sizeof(float)));
  return item;
}

TEST(InternalAuth, EveryMethodOfEveryInternalServiceChecksThePoolSecretFirst) {
  const PoolSecret secret = PoolSecret::Generate();
  const InternalAuth auth(secret);
  ControlService control(2, {}, {}, {}, kWorkerProtocolVersion, auth);
  auto worker = CpuWorker({auth, 0, ""});
  InProcessServer server({&control, worker.get()});
  ASSERT_TRUE(server.ok());
  grpc::ChannelArguments args;
  const auto none = grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(), args);
  const auto wrong = ChannelWithMetadata(server.address(), grpc::InsecureChannelCredentials(), args,
                                         kPoolSecretMetadataKey, secret.value() + "x");
  const auto right = auth.Channel(server.address(), args);
  const google::protobuf::FileDescriptor* file = iv1::WorkItem::descriptor()->file();
  ASSERT_EQ(file->service_count(), 2);
  int methods = 0;
  const int64_t refused_before = InternalAuth::refused();
  for (int s = 0; s < file->service_count(); ++s) {
    for (int m = 0; m < file->service(s)->method_count(); ++m, ++methods) {
      const std::string path = "/" + file->service(s)->full_name() + "/" + file->service(s)->method(m)->name();
      SCOPED_TRACE(path);
      for (const auto& channel : {none, wrong}) {
        const grpc::Status st = Call(channel, path);
        EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
        EXPECT_EQ(st.error_message().find(secret.value()), std::string::npos);
      }
      // With the secret the method runs (and fails or not on its own terms).
      const grpc::Status st = Call(right, path);
      EXPECT_NE(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
    }
  }
  EXPECT_EQ(methods, 13);  // Control: 5, Worker: 8; a new method is checked here too
  EXPECT_EQ(InternalAuth::refused() - refused_before, 2 * methods);
  control.Shutdown();
}

TEST(InternalAuth, AnInsecurePlaneChecksNothingAndSendsNothing) {
  const InternalAuth insecure = InternalAuth::Insecure();
  EXPECT_TRUE(insecure.insecure());
  grpc::ServerContext ctx;
  EXPECT_TRUE(insecure.Check(ctx, "Worker.Info").ok());
  EXPECT_EQ(InternalAuth(PoolSecret::Generate()).Check(ctx, "Worker.Info").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST(WorkerAdmission, ARunOfAnotherGenerationOrWithoutOneIsRefusedBeforeAnythingRuns) {
  auto worker = CpuWorker({InternalAuth::Insecure(), 3, ""});
  InProcessServer server({worker.get()});
  ASSERT_TRUE(server.ok());
  auto stub = iv1::Worker::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  iv1::WorkItem item;  // a lone vocab-parallel item: would wait for peers if run
  item.set_layout(iv1::VOCAB_PARALLEL);
  for (const std::string& generation : {std::string(""), std::string("2"), std::string("4")}) {
    SCOPED_TRACE(generation);
    grpc::ClientContext ctx;
    if (!generation.empty()) ctx.AddMetadata(kGenerationMetadataKey, generation);
    iv1::WorkResult result;
    const grpc::Status st = stub->Run(&ctx, item, &result);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_NE(st.error_message().find("this worker belongs to generation 3"), std::string::npos) << st.error_message();
  }
  // Its own generation's item runs (and is judged on its contents).
  grpc::ClientContext ctx;
  ctx.AddMetadata(kGenerationMetadataKey, "3");
  iv1::WorkResult result;
  const grpc::Status st = stub->Run(&ctx, TokenItem({0.f, 1.f, 2.f, 3.f}, 2), &result);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(result.token_logprobs_size(), 1);
  const double lse = std::log(1 + std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(result.token_logprobs(0), 2.0 - lse, 1e-6);
}

TEST(WorkerAdmission, TopKBeyondTheVocabularyIsInvalidBeforeAnythingIsAllocated) {
  auto worker = CpuWorker({});
  iv1::WorkItem item = TokenItem({0.f, 0.f, 0.f, 0.f}, 0);
  item.mutable_options()->set_topk(1 << 26);
  grpc::ServerContext ctx;
  iv1::WorkResult result;
  const grpc::Status st = worker->Run(&ctx, &item, &result);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("0 <= K <= V"), std::string::npos) << st.error_message();
}

TEST(PayloadRegions, OnlyTheFrontEndsOwnRegionsAreOpened) {
  EXPECT_TRUE(IsPoolRegionName("/logprob-12-0", ""));
  EXPECT_TRUE(IsPoolRegionName("/logprob-12-345", "/logprob-12-"));
  EXPECT_FALSE(IsPoolRegionName("/logprob-13-345", "/logprob-12-"));
  for (const std::string bad : {"/logprob-client-12-abc", "/logprob-12-", "/logprob-12-3x", "/other",
                                "/logprob-12-3/..", "", "/logprob--1", "/logprob-12-0\n"}) {
    EXPECT_FALSE(IsPoolRegionName(bad, "")) << bad;
    EXPECT_FALSE(IsPoolRegionName(bad, "/logprob-12-")) << bad;
  }
  // A client's region of this user, which the worker could open: refused by name.
  auto victim = SharedRegion::Create(64, "/logprob-client-" + std::to_string(getpid()) + "-victim");
  ASSERT_TRUE(victim.ok()) << victim.status();
  auto own = SharedRegion::Create(64);
  ASSERT_TRUE(own.ok()) << own.status();
  PayloadRegions regions(8, nullptr, OwnRegionPrefix());
  iv1::WorkItem item;
  item.mutable_shared_memory()->set_name((*victim)->name());
  item.mutable_shared_memory()->set_byte_size(16);
  std::shared_ptr<SharedRegion> hold;
  auto payload = regions.Payload(item, &hold);
  EXPECT_EQ(payload.status().code(), absl::StatusCode::kPermissionDenied) << payload.status();
  EXPECT_FALSE(hold);
  EXPECT_EQ(regions.mapped(), 0u);
  item.mutable_shared_memory()->set_name((*own)->name());
  payload = regions.Payload(item, &hold);
  EXPECT_TRUE(payload.ok()) << payload.status();
  // Another front-end's region (another pid) is not this pool's either.
  PayloadRegions other(8, nullptr, "/logprob-1-");
  hold.reset();
  EXPECT_EQ(other.Payload(item, &hold).status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(ControlStore, TakesOnlyTheCurrentGenerationsKeysWithinItsLimits) {
  ControlService control(1);
  grpc::ServerContext ctx;
  iv1::StoreSetRequest set;
  iv1::StoreSetReply reply;
  set.set_key("gen1/x");
  EXPECT_EQ(control.StoreSet(&ctx, &set, &reply).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  set.set_key("gen0/" + std::string(ControlService::kMaxStoreKeyBytes, 'k'));
  EXPECT_EQ(control.StoreSet(&ctx, &set, &reply).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  set.set_key("gen0/big");
  set.set_value(std::string(ControlService::kMaxStoreValueBytes + 1, 'v'));
  EXPECT_EQ(control.StoreSet(&ctx, &set, &reply).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // The whole store is bounded: values of 1 MiB fill it at 16 keys.
  set.set_value(std::string(ControlService::kMaxStoreValueBytes - 64, 'v'));
  int stored = 0;
  for (int i = 0; i < 64; ++i) {
    set.set_key(absl::StrCat("gen0/k", i));
    if (control.StoreSet(&ctx, &set, &reply).ok()) ++stored;
  }
  EXPECT_EQ(stored, static_cast<int>(ControlService::kMaxStoreBytes / ControlService::kMaxStoreValueBytes));
  // Overwriting a key reuses its bytes; a new generation starts empty.
  set.set_key("gen0/k0");
  EXPECT_TRUE(control.StoreSet(&ctx, &set, &reply).ok());
  control.Reset(1);
  set.set_key("gen1/k0");
  EXPECT_TRUE(control.StoreSet(&ctx, &set, &reply).ok());
  control.Shutdown();
}

TEST(ControlLmHeadRows, OnlyMembersOfTheCurrentGenerationGetRowsOfATensorInsideItsFile) {
  const std::string file = ::testing::TempDir() + "/rows_head." + std::to_string(getpid()) + ".safetensors";
  ASSERT_TRUE(WriteRandomLmHead(file, 16, 8, 1).ok());
  const PoolSecret secret = PoolSecret::Generate();
  const InternalAuth auth(secret);
  ControlService control(1, {}, {}, {}, kWorkerProtocolVersion, auth);
  control.SetLmHeadFiles([&](const std::string& f) { return f == file; });
  control.Reset(2);
  InProcessServer server({&control});
  ASSERT_TRUE(server.ok());
  auto stub = iv1::Control::NewStub(auth.Channel(server.address(), grpc::ChannelArguments()));
  const auto read = [&](int64_t generation, int64_t hidden) {
    iv1::LmHeadRowsRequest req;
    req.mutable_source()->set_file(file);
    req.mutable_source()->set_dtype(v1::BF16);
    req.mutable_source()->set_vocab_size(16);
    req.mutable_source()->set_hidden_size(hidden);
    req.set_row_end(1);
    req.set_generation(generation);
    grpc::ClientContext ctx;
    auto reader = stub->ReadLmHeadRows(&ctx, req);
    iv1::LmHeadRowsChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return reader->Finish();
  };
  EXPECT_EQ(read(1, 8).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const grpc::Status huge = read(2, int64_t{1} << 24);  // a shape beyond the file's bytes
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << huge.error_message();
  EXPECT_NE(huge.error_message().find("does not lie inside"), std::string::npos) << huge.error_message();
  EXPECT_EQ(read(2, int64_t{1} << 28).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(read(2, 8).ok());
  control.Shutdown();
  std::remove(file.c_str());
}

}  // namespace
}  // namespace logprob::testing
