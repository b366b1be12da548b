// Heads without a shared filesystem (docs/cluster.md): a head declared by
// shape (--lm-head-declare, server/heads/lm_head_declared.h) is refused until its
// first commit and then serves like any head; Control.ReadLmHeadRows
// (server/pool/control_lm_head_rows.cc) streams a worker's slice of a file the
// front-end serves, read back by the worker's fetcher
// (worker/heads/frontend_lm_head_rows.h) byte for byte as ReadLmHeadRows reads
// the file, and refuses other files and bad ranges.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/lm_head_source.h"
#include "common/lm_head_store_name.h"
#include "common/safetensors.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "server/heads/lm_head_declared.h"
#include "server/heads/lm_heads.h"
#include "server/pool/control_service.h"
#include "server/pool/lm_head_files.h"
#include "tests/test_support.h"
#include "worker/heads/frontend_lm_head_rows.h"

namespace logprob::testing {
namespace {

TEST(DeclaredLmHead, ParsesNameShapeAndDtype) {
  auto v = ParseDeclaredLmHead("policy=151936x4096:bf16", 4);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->head, "policy");
  EXPECT_EQ(v->source.vocab_size, 151936);
  EXPECT_EQ(v->source.hidden_size, 4096);
  EXPECT_EQ(v->source.dtype, v1::BF16);
  EXPECT_EQ(v->bytes_per_worker, 37984 * 4096 * 2);  // SplitRange(151936, 4, 0): 37984 rows
  EXPECT_TRUE(IsDeclaredPlaceholder(*v));
  auto f32 = ParseDeclaredLmHead("r=3x2:F32", 1);
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ(f32->source.dtype, v1::F32);
}

TEST(DeclaredLmHead, RefusesMalformedDeclarationsNamingTheFlag) {
  for (const std::string bad :
       {"policy", "policy=10x4", "policy=10:bf16", "policy=0x4:bf16", "policy=10x-4:bf16", "policy=10x4:i32",
        "policy=10x4:f64", "bad name=10x4:bf16", "policy=10x4x2:bf16", "policy=3000000000x4:bf16", "=10x4:bf16"}) {
    SCOPED_TRACE(bad);
    auto v = ParseDeclaredLmHead(bad, 2);
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(v.status().message().find("--lm-head-declare"), std::string::npos) << v.status();
  }
}

/// A committed version of head `name` (as LmHeadUpdates commits one).
LmHeadVersion Version(const std::string& name, const std::string& version, const std::string& file) {
  LmHeadVersion v;
  v.head = name;
  v.version = version;
  v.origin = kUpdateOrigin;
  v.source.file = file;
  v.source.tensor = kLmHeadTensor;
  v.source.dtype = v1::BF16;
  v.source.vocab_size = 10;
  v.source.hidden_size = 4;
  v.sha256 = KnownSha256(std::string(64, 'a'));
  return v;
}

TEST(DeclaredLmHead, IsRefusedUntilTheFirstCommitThenServes) {
  LmHeads::Options o;
  o.retain = 2;
  LmHeads heads(o);
  ASSERT_TRUE(heads.Declare(*ParseDeclaredLmHead("policy=10x4:bf16", 2)).ok());
  EXPECT_EQ(heads.Declare(*ParseDeclaredLmHead("policy=10x4:bf16", 2)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(heads.empty());
  auto bound = heads.Bind("policy", "");
  ASSERT_FALSE(bound.ok());
  EXPECT_EQ(bound.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(bound.status().message().find("declared"), std::string::npos) << bound.status();
  EXPECT_FALSE(heads.Bind("", "").ok());  // the only head, still empty
  // Updates see its shape; workers load nothing for it; no version name is taken.
  auto current = heads.Current("policy");
  ASSERT_TRUE(current.ok()) << current.status();
  EXPECT_EQ((*current)->source.vocab_size, 10);
  EXPECT_TRUE(heads.Alive().empty());
  EXPECT_FALSE(heads.Taken("policy", "").has_value());
  EXPECT_EQ(heads.Find("policy", ""), nullptr);
  std::vector<v1::LmHeadInfo> listed = heads.List();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].version(), "");
  EXPECT_EQ(listed[0].retained_versions_size(), 0);
  EXPECT_EQ(listed[0].source(), "declared");
  EXPECT_EQ(listed[0].vocab_size(), 10);

  ASSERT_TRUE(heads.Commit(Version("policy", "v1", "/store/policy-0.safetensors")).ok());
  bound = heads.Bind("policy", "");
  ASSERT_TRUE(bound.ok()) << bound.status();
  EXPECT_EQ((*bound)->version, "v1");
  ASSERT_TRUE(heads.Commit(Version("policy", "v2", "/store/policy-1.safetensors")).ok());
  listed = heads.List();
  ASSERT_EQ(listed[0].retained_versions_size(), 2);  // the placeholder is gone, not retained
  EXPECT_EQ(listed[0].retained_versions(0), "v2");
  EXPECT_EQ(listed[0].retained_versions(1), "v1");
  EXPECT_EQ(heads.Alive().size(), 2u);
}

TEST(DeclaredLmHead, TheServerRefusesADeclarationItCannotServe) {
  const std::string server = absl::StrCat("timeout 60 ", BinDir(), "/logprob-server --listen 127.0.0.1:0 --workers 1 ");
  // No updates: nothing could ever fill it.
  CommandResult r = RunCommand(server + "--lm-head-declare policy=10x4:bf16");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("add --allow-lm-head-updates"), std::string::npos) << r.output;
  r = RunCommand(server + "--allow-lm-head-updates --lm-head-declare policy=10x4");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("--lm-head-declare policy=10x4: no :DTYPE"), std::string::npos) << r.output;
  // A second head of the name.
  r = RunCommand(server + "--allow-lm-head-updates --lm-head-declare p=10x4:bf16 --lm-head-declare p=10x4:f32");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("a second head named \"p\""), std::string::npos) << r.output;
}

TEST(LmHeadFiles, ServesTheStoreAndLiveVersionsOnly) {
  EXPECT_TRUE(IsCommittedStoreFile("/dev/shm/s/policy-0.safetensors", "/dev/shm/s"));
  EXPECT_TRUE(IsCommittedStoreFile("/dev/shm/s/policy-0.bias.safetensors", "/dev/shm/s"));
  for (const std::string other : {"/dev/shm/s/policy-0.safetensors.partial", "/dev/shm/s/sub/x", "/dev/shm/s/..",
                                  "/dev/shm/s/", "/dev/shm/sx/policy-0.safetensors", "/etc/passwd", "/dev/shm/s"})
    EXPECT_FALSE(IsCommittedStoreFile(other, "/dev/shm/s")) << other;
  EXPECT_FALSE(IsCommittedStoreFile("/x", ""));
  internal::v1::LmHeadLoad load;
  load.mutable_source()->set_file("/ckpt/model.safetensors");
  load.mutable_source()->set_bias_file("/ckpt/bias.safetensors");
  EXPECT_TRUE(IsLiveLmHeadFile("/ckpt/model.safetensors", {load}));
  EXPECT_TRUE(IsLiveLmHeadFile("/ckpt/bias.safetensors", {load}));
  EXPECT_FALSE(IsLiveLmHeadFile("/ckpt/other.safetensors", {load}));
  EXPECT_FALSE(IsLiveLmHeadFile("", {internal::v1::LmHeadLoad()}));  // "" never names a file
}

/// A ControlService whose ReadLmHeadRows serves `allowed` only, on a free port.
class RowsServer {
 public:
  explicit RowsServer(const std::string& allowed) : control_(1) {
    control_.SetLmHeadFiles([allowed](const std::string& f) { return f == allowed; });
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&control_);
    server_ = builder.BuildAndStart();
  }
  ~RowsServer() {
    control_.Shutdown();
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  LmHeadRowFetcher Fetcher() const {
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::InsecureChannelCredentials());
    return FrontendLmHeadRows(std::shared_ptr<internal::v1::Control::Stub>(internal::v1::Control::NewStub(channel)),
                              /*generation=*/0, std::chrono::seconds(60));
  }
  bool ok() const { return server_ && port_ > 0; }

 private:
  ControlService control_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

internal::v1::LmHeadSource ProtoOf(const LmHeadSource& s) {
  internal::v1::LmHeadSource p;
  p.set_file(s.file);
  p.set_tensor(s.tensor);
  p.set_dtype(s.dtype);
  p.set_vocab_size(s.vocab_size);
  p.set_hidden_size(s.hidden_size);
  p.set_data_offset(s.data_offset);
  return p;
}

TEST(ReadLmHeadRows, StreamsAWorkersSliceAsTheFileHoldsIt) {
  // 5000 x 512 bf16 = 5 MB: more than one 4 MiB piece.
  const std::string path = absl::StrCat(::testing::TempDir(), "/lm_head_remote_test.", getpid(), ".safetensors");
  ASSERT_TRUE(WriteRandomLmHead(path, 5000, 512, 7).ok());
  auto source = ResolveLmHead(path);
  ASSERT_TRUE(source.ok()) << source.status();
  RowsServer server(path);
  ASSERT_TRUE(server.ok());
  const LmHeadRowFetcher fetch = server.Fetcher();
  for (const auto& [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 5000}, {2500, 5000}, {17, 18}, {9, 9}}) {
    SCOPED_TRACE(absl::StrCat(b, "..", e));
    std::vector<char> want(static_cast<size_t>((e - b) * 512 * 2)), got(want.size(), 0x5a);
    ASSERT_TRUE(ReadLmHeadRows(*source, b, e, want.data()).ok());
    const absl::Status st = fetch(ProtoOf(*source), b, e, got.data(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(want, got);
  }
  std::vector<char> buf(512 * 2 * 10);
  // Outside [0, V]: INVALID_ARGUMENT from the front-end.
  absl::Status st = fetch(ProtoOf(*source), 4995, 5005, buf.data(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // A file the front-end does not serve heads from: PERMISSION_DENIED.
  internal::v1::LmHeadSource other = ProtoOf(*source);
  other.set_file("/etc/passwd");
  st = fetch(other, 0, 1, buf.data(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_NE(st.message().find("/etc/passwd"), std::string::npos) << st;
  // A bias file it does not serve either.
  other = ProtoOf(*source);
  other.set_bias_file("/etc/passwd");
  other.set_bias_dtype(v1::F32);
  std::vector<float> bias(1);
  st = fetch(other, 0, 1, buf.data(), bias.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  unlink(path.c_str());
}

TEST(ReadLmHeadRows, StreamsTheBiasAsF32InPieces) {
  // V = 600000 bias elements (2.4 MB of f32: three pieces), H = 1.
  const int64_t V = 600000;
  const std::string path = absl::StrCat(::testing::TempDir(), "/lm_head_remote_bias_test.", getpid(), ".safetensors");
  std::vector<uint16_t> w(V), b(V);
  for (int64_t i = 0; i < V; ++i) {
    w[i] = FloatToBf16(static_cast<float>(i % 97) / 97.f);
    b[i] = FloatToBf16(static_cast<float>(i % 89) - 44.f);
  }
  v1::Tensor tw, tb;
  tw.set_name("lm_head.weight");
  tw.set_dtype(v1::BF16);
  tw.add_shape(V);
  tw.add_shape(1);
  tw.set_data(w.data(), w.size() * 2);
  tb.set_name("lm_head.bias");
  tb.set_dtype(v1::BF16);
  tb.add_shape(V);
  tb.set_data(b.data(), b.size() * 2);
  ASSERT_TRUE(WriteSafetensors(path, {tw, tb}).ok());
  auto source = ResolveLmHead(path);
  ASSERT_TRUE(source.ok()) << source.status();
  ASSERT_TRUE(source->transform.has_bias);
  internal::v1::LmHeadSource proto = ProtoOf(*source);
  proto.set_bias_file(source->bias.file);
  proto.set_bias_tensor(source->bias.tensor);
  proto.set_bias_dtype(source->bias.dtype);
  proto.set_bias_offset(source->bias.data_offset);
  RowsServer server(path);
  ASSERT_TRUE(server.ok());
  const int64_t rb = 1000, re = V;
  std::vector<float> want_bias(re - rb), got_bias(re - rb, -1.f);
  std::vector<char> want_rows((re - rb) * 2), got_rows(want_rows.size());
  ASSERT_TRUE(ReadLmHeadBias(*source, rb, re, want_bias.data()).ok());
  ASSERT_TRUE(ReadLmHeadRows(*source, rb, re, want_rows.data()).ok());
  const absl::Status st = server.Fetcher()(proto, rb, re, got_rows.data(), got_bias.data());
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(want_bias, got_bias);
  EXPECT_EQ(want_rows, got_rows);
  unlink(path.c_str());
}

TEST(FetchMode, AutoFetchesOnlyWhatThisHostCannotRead) {
  auto mode = ParseLmHeadFetchMode("auto");
  ASSERT_TRUE(mode.ok());
  EXPECT_FALSE(ParseLmHeadFetchMode("sometimes").ok());
  internal::v1::LmHeadSource here;
  here.set_file("/proc/self/status");  // readable
  internal::v1::LmHeadSource elsewhere;
  elsewhere.set_file("/nonexistent/lm_head_remote_test/x.safetensors");
  EXPECT_FALSE(ShouldFetchLmHead(LmHeadFetchMode::kAuto, here));
  EXPECT_TRUE(ShouldFetchLmHead(LmHeadFetchMode::kAuto, elsewhere));
  here.set_bias_file(elsewhere.file());
  EXPECT_TRUE(ShouldFetchLmHead(LmHeadFetchMode::kAuto, here));  // its bias is not here
  EXPECT_TRUE(ShouldFetchLmHead(LmHeadFetchMode::kAlways, here));
  EXPECT_FALSE(ShouldFetchLmHead(LmHeadFetchMode::kNever, elsewhere));
}

}  // namespace
}  // namespace logprob::testing
