// Shared-memory inputs through a live server (server/inputs/client_regions.h,
// client/shm_inputs.h):
// - register / use / list / unregister; golden cases scored through a
//   region are bitwise the inline results and match the expected outputs
//   (logits, packed, hidden states);
// - unknown region (NOT_FOUND), a reference past the region's end or
//   misaligned, or of the wrong size (INVALID_ARGUMENT naming the tensor);
// - a region truncated before a request, and while the request waits in
//   the queue: a clear FAILED_PRECONDITION, and the server keeps serving;
// - a second session cannot use or remove the first one's region;
// - a session that only names another's object (cannot write it) gets no
//   usable region: the proof of write access fails, nothing is read;
// - names that are not plain shm names, the server's own payload regions,
//   missing session keys are refused; the count and byte caps give
//   RESOURCE_EXHAUSTED; --shared-memory-inputs=false turns it all off;
// - an idle session's regions are removed (observed on /metrics).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "client/shm_inputs.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/safetensors.h"
#include "common/shared_memory.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr int kWorkers = 2;
constexpr int64_t kV = 32000, kH = 1024;  // the slow workload's lm_head

/// The output tensors of a response, serialized: equal strings mean
/// bitwise-equal outputs.
std::string OutputBytes(const v1::ScoreResponse& r) {
  std::string s;
  for (const auto& t : r.outputs()) s += t.SerializeAsString();
  return s;
}

/// A POSIX shared-memory object of this test, mapped read-write; unlinked
/// by the destructor.
class TestRegion {
 public:
  explicit TestRegion(size_t size)
      : name_("/logprob-test-" + std::to_string(getpid()) + "-" + std::to_string(next_++)), size_(size) {
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << name_ << ": " << std::strerror(errno);
    // The last kShmProofBytes past `size`: the proof of write access.
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size + kShmProofBytes)), 0);
    fd_ = fd;
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_NE(p, MAP_FAILED);
    data_ = static_cast<char*>(p);
  }
  ~TestRegion() {
    munmap(data_, size_);
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  char* data() const { return data_; }
  /// Shrinks (or grows) the object; the mapping is not touched afterwards.
  void Truncate(size_t size) { ASSERT_EQ(ftruncate(fd_, static_cast<off_t>(size)), 0); }

  /// Writes every input's bytes of `req` one after another (64-byte
  /// aligned) and replaces them by references to region `region`.
  void Place(v1::ScoreRequest* req, const std::string& region) {
    size_t at = 0;
    for (v1::Tensor& t : *req->mutable_inputs()) {
      const size_t n = t.data().size();
      std::memcpy(data_ + at, t.data().data(), n);
      t.mutable_shared_memory()->set_region(region);  // replaces data (Tensor.source is a oneof)
      t.mutable_shared_memory()->set_offset(static_cast<int64_t>(at));
      t.mutable_shared_memory()->set_byte_size(static_cast<int64_t>(n));
      at += (n + 63) & ~size_t{63};
    }
    ASSERT_LE(at, size_);
  }

 private:
  static inline int next_ = 0;
  std::string name_;
  size_t size_;
  int fd_ = -1;
  char* data_ = nullptr;
};

/// Calls of one shared-memory session (its `logprob-shm-session` key).
struct Session {
  std::string key;
  v1::LogprobService::Stub& stub;
  /// The reason (logprob-error-reason) of the last call that failed
  /// (atomic: a test may call from several threads).
  mutable std::atomic<v1::ErrorReason> reason{v1::ERROR_REASON_UNSPECIFIED};

  /// `s`, the status of a call on `ctx`, its reason kept in `reason`.
  grpc::Status Kept(const grpc::ClientContext& ctx, grpc::Status s) const {
    reason = s.ok() ? v1::ERROR_REASON_UNSPECIFIED : SentReason(ctx);
    return s;
  }
  void Attach(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
    if (!key.empty()) ctx->AddMetadata("logprob-shm-session", key);
  }
  /// RegisterSharedMemory only: the region stays unconfirmed.
  grpc::Status RegisterUnconfirmed(const std::string& name, const std::string& shm_name, int64_t size,
                                   v1::RegisterSharedMemoryResponse* resp) const {
    grpc::ClientContext ctx;
    Attach(&ctx);
    v1::RegisterSharedMemoryRequest req;
    req.set_name(name);
    req.set_shm_name(shm_name);
    req.set_byte_size(size);
    return Kept(ctx, stub.RegisterSharedMemory(&ctx, req, resp));
  }
  grpc::Status Confirm(const std::string& name) const {
    grpc::ClientContext ctx;
    Attach(&ctx);
    v1::ConfirmSharedMemoryRequest req;
    req.set_name(name);
    v1::ConfirmSharedMemoryResponse resp;
    return Kept(ctx, stub.ConfirmSharedMemory(&ctx, req, &resp));
  }
  /// What a client that can write the object does: register, write the
  /// challenge where the server says, confirm.
  grpc::Status Register(const std::string& name, const std::string& shm_name, int64_t size) const {
    v1::RegisterSharedMemoryResponse resp;
    grpc::Status s = RegisterUnconfirmed(name, shm_name, size, &resp);
    if (!s.ok()) return s;
    EXPECT_EQ(resp.challenge().size(), static_cast<size_t>(kShmProofBytes));
    const int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
    EXPECT_GE(fd, 0) << shm_name << ": " << std::strerror(errno);
    EXPECT_EQ(pwrite(fd, resp.challenge().data(), resp.challenge().size(), resp.proof_offset()),
              static_cast<ssize_t>(resp.challenge().size()));
    close(fd);
    return Confirm(name);
  }
  grpc::Status Unregister(const std::string& name, int* n = nullptr) const {
    grpc::ClientContext ctx;
    Attach(&ctx);
    v1::UnregisterSharedMemoryRequest req;
    req.set_name(name);
    v1::UnregisterSharedMemoryResponse resp;
    grpc::Status s = Kept(ctx, stub.UnregisterSharedMemory(&ctx, req, &resp));
    if (n) *n = resp.unregistered();
    return s;
  }
  std::vector<std::string> List() const {
    grpc::ClientContext ctx;
    Attach(&ctx);
    v1::ListSharedMemoryResponse resp;
    const grpc::Status s = stub.ListSharedMemory(&ctx, v1::ListSharedMemoryRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::vector<std::string> names;
    for (const auto& r : resp.regions())
      names.push_back(r.name() + ":" + std::to_string(r.byte_size()) + (r.confirmed() ? "" : ":unconfirmed"));
    return names;
  }
  grpc::Status Score(const v1::ScoreRequest& req, v1::ScoreResponse* resp) const {
    grpc::ClientContext ctx;
    Attach(&ctx);
    return Kept(ctx, stub.Score(&ctx, req, resp));
  }
};

/// Writes `bf16_path`'s `lm_head.weight` (BF16) as F32 to `path`: the same
/// values (bf16 widens exactly), so hidden-states results stay within the
/// SPEC tolerance of the bf16 references, and the F32 GEMM runs on CPUs
/// without oneDNN bf16 support (AVX2-only machines).
std::string F32LmHead(const std::string& bf16_path, const std::string& tag) {
  const std::string path =
      ::testing::TempDir() + "/" + tag + "_f32_lm_head." + std::to_string(getpid()) + ".safetensors";
  auto file = ReadSafetensors(bf16_path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return path;
  const v1::Tensor* w = file->Find("lm_head.weight");
  EXPECT_TRUE(w != nullptr && w->dtype() == v1::BF16);
  if (w == nullptr) return path;
  const size_t n = w->data().size() / 2;
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, w->data().data() + 2 * i, 2);
    f[i] = Bf16ToFloat(b);
  }
  v1::Tensor t = *w;
  t.set_dtype(v1::F32);
  t.set_data(f.data(), n * sizeof(float));
  const absl::Status st = WriteSafetensors(path, {t});
  EXPECT_TRUE(st.ok()) << st;
  return path;
}

class SharedMemoryInputs : public ::testing::Test {
 protected:
  std::unique_ptr<ServerProcess> StartServer(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> flags = {"--metrics-listen", "127.0.0.1:" + std::to_string(metrics_port_)};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return ServerProcess::Start(kWorkers, flags);
  }
  const int metrics_port_ = FreePort();
};

TEST_F(SharedMemoryInputs, ServerInfoReportsTheHostAndLimits) {
  auto server = StartServer({"--max-shared-memory-bytes", "1048576", "--max-shared-memory-regions", "3"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  EXPECT_TRUE(info.shared_memory_inputs());
  EXPECT_EQ(info.host_id().size(), 32u);
  EXPECT_EQ(info.host_id(), SharedMemoryHostId()) << "same machine, same /dev/shm";
  EXPECT_TRUE(client::SameSharedMemoryHost(info));
  EXPECT_EQ(info.max_shared_memory_bytes(), 1048576);
  EXPECT_EQ(info.max_shared_memory_regions(), 3);
  EXPECT_DOUBLE_EQ(info.shared_memory_idle_timeout_seconds(), 300);
}

TEST_F(SharedMemoryInputs, GoldenCasesThroughARegionAreBitwiseInline) {
  HiddenWorkload work("shm_golden", 3000, 256, 11, 1, 37);
  const std::string lm_head = F32LmHead(work.lm_head, "shm_golden");
  auto server = StartServer({"--lm-head", lm_head});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  client::ShmInputs shm(*stub, 60);
  std::vector<std::pair<std::string, v1::ScoreRequest>> cases;
  std::vector<GoldenCase> goldens;
  for (const std::string& name : LogitsGoldenNames()) goldens.push_back(LoadGolden(name));
  goldens.push_back(LoadGolden("hidden_bf16"));
  for (const GoldenCase& g : goldens) cases.push_back({g.name, GoldenRequest(g)});
  cases.push_back({"random hidden", work.quick});
  // The golden hidden case needs its own lm_head: a second server.
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].first);
    if (cases[i].first == "hidden_bf16") continue;
    grpc::ClientContext inline_ctx;
    v1::ScoreResponse inline_resp;
    ASSERT_TRUE(stub->Score(&inline_ctx, cases[i].second, &inline_resp).ok());
    v1::ScoreRequest placed = cases[i].second;
    ASSERT_TRUE(shm.Place(&placed).ok());
    for (const auto& t : placed.inputs()) ASSERT_TRUE(t.data().empty() && t.has_shared_memory());
    grpc::ClientContext ctx;
    shm.Attach(&ctx);
    v1::ScoreResponse resp;
    const grpc::Status s = stub->Score(&ctx, placed, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(OutputBytes(resp) == OutputBytes(inline_resp)) << "shared-memory result differs from inline";
    if (i < goldens.size()) {
      const std::vector<v1::Tensor> got(resp.outputs().begin(), resp.outputs().end());
      EXPECT_EQ(CompareOutputs(goldens[i].expected.tensors, got), "");
    }
  }
  // The hidden-states golden case on a server with its lm_head.
  const std::string golden_lm_head = F32LmHead(GoldenDir() + "/hidden_bf16.lm_head.safetensors", "shm_golden_case");
  auto hidden_server = ServerProcess::Start(kWorkers, {"--lm-head", golden_lm_head});
  ASSERT_TRUE(hidden_server);
  auto hidden_stub = hidden_server->NewStub();
  client::ShmInputs hidden_shm(*hidden_stub, 60);
  v1::ScoreRequest placed = GoldenRequest(goldens.back());
  ASSERT_TRUE(hidden_shm.Place(&placed).ok());
  grpc::ClientContext ctx;
  hidden_shm.Attach(&ctx);
  v1::ScoreResponse resp;
  const grpc::Status s = hidden_stub->Score(&ctx, placed, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::vector<v1::Tensor> got(resp.outputs().begin(), resp.outputs().end());
  EXPECT_EQ(CompareOutputs(goldens.back().expected.tensors, got), "");
  std::filesystem::remove(lm_head);
  std::filesystem::remove(golden_lm_head);
}

TEST_F(SharedMemoryInputs, RegisterUseListUnregister) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const GoldenCase g = LoadGolden("packed_bf16");
  TestRegion region(4 << 20);
  Session a{"session-a-0123456789abcdef", *stub};
  ASSERT_TRUE(a.Register("in", region.name(), 4 << 20).ok());
  EXPECT_EQ(a.Register("in", region.name(), 4 << 20).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(a.List(), std::vector<std::string>{"in:4194304"});
  EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_shared_memory_regions", 1));
  EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_shared_memory_bytes", 4 << 20));

  v1::ScoreRequest req = GoldenRequest(g);
  v1::ScoreResponse inline_resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Score(&ctx, req, &inline_resp).ok());
  }
  region.Place(&req, "in");
  v1::ScoreResponse resp;
  grpc::Status s = a.Score(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(OutputBytes(resp) == OutputBytes(inline_resp));

  // The same bytes through a stream.
  {
    grpc::ClientContext ctx;
    a.Attach(&ctx);
    auto stream = stub->ScoreStream(&ctx);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(stream->Write(req));
    stream->WritesDone();
    v1::ScoreResponse r;
    int n = 0;
    while (stream->Read(&r)) {
      EXPECT_EQ(r.status_code(), 0) << r.status_message();
      EXPECT_TRUE(OutputBytes(r) == OutputBytes(inline_resp));
      ++n;
    }
    EXPECT_EQ(n, 3);
    EXPECT_TRUE(stream->Finish().ok());
  }

  int n = -1;
  ASSERT_TRUE(a.Unregister("in", &n).ok());
  EXPECT_EQ(n, 1);
  EXPECT_TRUE(a.List().empty());
  EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_shared_memory_regions", 0));
  EXPECT_EQ(a.Unregister("in").error_code(), grpc::StatusCode::NOT_FOUND);
  s = a.Score(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("\"logits\""), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("\"in\""), std::string::npos) << s.error_message();
}

TEST_F(SharedMemoryInputs, BadReferencesNameTheTensor) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const GoldenCase g = LoadGolden("basic_f32");
  TestRegion region(1 << 20);
  Session a{"session-bad-refs-0123456789", *stub};
  ASSERT_TRUE(a.Register("r", region.name(), 1 << 20).ok());
  v1::ScoreRequest placed = GoldenRequest(g);
  region.Place(&placed, "r");
  auto input = [&](v1::ScoreRequest& r, const std::string& name) -> v1::Tensor& {
    for (auto& t : *r.mutable_inputs())
      if (t.name() == name) return t;
    ADD_FAILURE() << "no " << name;
    return *r.mutable_inputs(0);
  };
  struct Bad {
    std::string label, tensor;
    std::function<void(v1::Tensor&)> edit;
    grpc::StatusCode code;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {"unknown region", "input_ids", [](v1::Tensor& t) { t.mutable_shared_memory()->set_region("nope"); },
       grpc::StatusCode::NOT_FOUND, "\"nope\""},
      {"past the end", "logits",
       [](v1::Tensor& t) { t.mutable_shared_memory()->set_offset((1 << 20) - t.shared_memory().byte_size() + 4); },
       grpc::StatusCode::INVALID_ARGUMENT, "outside region"},
      {"negative offset", "logits", [](v1::Tensor& t) { t.mutable_shared_memory()->set_offset(-4); },
       grpc::StatusCode::INVALID_ARGUMENT, "outside region"},
      {"misaligned", "logits",
       [](v1::Tensor& t) { t.mutable_shared_memory()->set_offset(t.shared_memory().offset() + 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "not a multiple of F32's 4 bytes"},
      {"wrong size", "input_ids",
       [](v1::Tensor& t) { t.mutable_shared_memory()->set_byte_size(t.shared_memory().byte_size() - 8); },
       grpc::StatusCode::INVALID_ARGUMENT, "bytes but shape"},
      // Tensor.source is a oneof: data replaces the reference.
      {"data replaces the reference", "logits", [](v1::Tensor& t) { t.set_data("xxxx"); },
       grpc::StatusCode::INVALID_ARGUMENT, "data is 4 bytes but shape"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.label);
    v1::ScoreRequest r = placed;
    b.edit(input(r, b.tensor));
    v1::ScoreResponse resp;
    const grpc::Status s = a.Score(r, &resp);
    EXPECT_EQ(s.error_code(), b.code) << s.error_message();
    EXPECT_NE(s.error_message().find("\"" + b.tensor + "\""), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find(b.says), std::string::npos) << s.error_message();
  }
  // No session key: refused before any lookup.
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  const grpc::Status s = stub->Score(&ctx, placed, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("logprob-shm-session"), std::string::npos) << s.error_message();
}

TEST_F(SharedMemoryInputs, RegionsAreInvisibleToOtherSessions) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  TestRegion region(1 << 20);
  Session a{"session-owner-0123456789ab", *stub};
  Session b{"session-other-0123456789ab", *stub};
  ASSERT_TRUE(a.Register("mine", region.name(), 1 << 20).ok());
  v1::ScoreRequest req = GoldenRequest(LoadGolden("basic_f32"));
  region.Place(&req, "mine");
  v1::ScoreResponse resp;
  grpc::Status s = b.Score(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << "another session's region name must not resolve";
  EXPECT_EQ(b.reason.load(), v1::SHARED_MEMORY_REGION_NOT_REGISTERED) << s.error_message();
  EXPECT_TRUE(b.List().empty());
  EXPECT_EQ(b.Unregister("mine").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(b.reason.load(), v1::SHARED_MEMORY_REGION_NOT_REGISTERED);
  EXPECT_EQ(b.Confirm("mine").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(b.reason.load(), v1::SHARED_MEMORY_REGION_NOT_REGISTERED);
  // An object the server cannot open (here: none of that name): send inline.
  v1::RegisterSharedMemoryResponse unused;
  EXPECT_EQ(b.RegisterUnconfirmed("gone", "/reasons-test-no-such-object", 1 << 20, &unused).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(b.reason.load(), v1::SHARED_MEMORY_UNAVAILABLE);
  int n = -1;
  ASSERT_TRUE(b.Unregister("", &n).ok());
  EXPECT_EQ(n, 0);
  EXPECT_EQ(a.List(), std::vector<std::string>{"mine:1048576"});
  s = a.Score(req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// The attack of a second local user: a 0600 object of the server's user,
// whose name anyone sees in /dev/shm, registered by a session that can
// only name it (it cannot write the object; here: it does not). The
// registration stays unconfirmed, a request referencing it is refused
// before any byte is read, the proof fails, and nothing about the object's
// contents comes back. A real second uid: the Python client's
// test_shared_memory.SharedMemoryTest.test_second_user_cannot_register.
TEST_F(SharedMemoryInputs, ANameAloneDoesNotGiveTheRegion) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  TestRegion victim(1 << 20);
  Session owner{"session-victim-0123456789ab", *stub};
  ASSERT_TRUE(owner.Register("in", victim.name(), 1 << 20).ok());
  const v1::ScoreRequest plain = GoldenRequest(LoadGolden("basic_f32"));
  v1::ScoreRequest req = plain;
  victim.Place(&req, "in");
  v1::ScoreResponse owners;
  ASSERT_TRUE(owner.Score(req, &owners).ok());
  ASSERT_GT(owners.outputs_size(), 0);

  Session attacker{"session-attacker-0123456789", *stub};
  v1::RegisterSharedMemoryResponse challenge;
  ASSERT_TRUE(attacker.RegisterUnconfirmed("stolen", victim.name(), 1 << 20, &challenge).ok());
  EXPECT_EQ(challenge.challenge().size(), static_cast<size_t>(kShmProofBytes));
  EXPECT_EQ(challenge.proof_offset(), 1 << 20);
  EXPECT_EQ(attacker.List(), std::vector<std::string>{"stolen:1048576:unconfirmed"});
  v1::ScoreRequest stolen = req;
  for (auto& t : *stolen.mutable_inputs()) t.mutable_shared_memory()->set_region("stolen");
  auto refused = [&](grpc::StatusCode code, const std::string& says) {
    v1::ScoreResponse resp;
    const grpc::Status s = attacker.Score(stolen, &resp);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(says), std::string::npos) << s.error_message();
    EXPECT_EQ(resp.outputs_size(), 0) << "nothing computed from the object may come back";
    // A stream answers the same, in the message.
    grpc::ClientContext ctx;
    attacker.Attach(&ctx);
    auto stream = stub->ScoreStream(&ctx);
    ASSERT_TRUE(stream->Write(stolen));
    stream->WritesDone();
    v1::ScoreResponse r;
    ASSERT_TRUE(stream->Read(&r));
    EXPECT_EQ(r.status_code(), static_cast<int>(code)) << r.status_message();
    EXPECT_EQ(r.outputs_size(), 0);
    EXPECT_TRUE(stream->Finish().ok());
  };
  refused(grpc::StatusCode::PERMISSION_DENIED, "\"stolen\" is not confirmed");

  // The object holds its owner's challenge (or nothing), never this one.
  const grpc::Status confirm = attacker.Confirm("stolen");
  EXPECT_EQ(confirm.error_code(), grpc::StatusCode::PERMISSION_DENIED) << confirm.error_message();
  EXPECT_NE(confirm.error_message().find("\"stolen\""), std::string::npos) << confirm.error_message();
  EXPECT_NE(confirm.error_message().find("only a process that can write the object"), std::string::npos)
      << confirm.error_message();
  EXPECT_TRUE(attacker.List().empty()) << "a failed proof removes the registration";
  refused(grpc::StatusCode::NOT_FOUND, "\"stolen\"");
  // The owner's region, named from the attacker's session: not there.
  EXPECT_EQ(attacker.Confirm("in").error_code(), grpc::StatusCode::NOT_FOUND);
  v1::ScoreResponse resp;
  EXPECT_EQ(attacker.Score(req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(resp.outputs_size(), 0);
  // Registering anew gives a new challenge; the old one proves nothing.
  v1::RegisterSharedMemoryResponse again;
  ASSERT_TRUE(attacker.RegisterUnconfirmed("stolen", victim.name(), 1 << 20, &again).ok());
  EXPECT_NE(again.challenge(), challenge.challenge());
  EXPECT_EQ(attacker.Confirm("stolen").error_code(), grpc::StatusCode::PERMISSION_DENIED);

  // The owner is unaffected.
  v1::ScoreResponse after;
  ASSERT_TRUE(owner.Score(req, &after).ok());
  EXPECT_TRUE(OutputBytes(after) == OutputBytes(owners));
  const CommandResult m = ScrapeMetrics(metrics_port_);
  EXPECT_EQ(MetricSample(m.output, R"(logprob_requests_total{code="PERMISSION_DENIED",method="ConfirmSharedMemory"})"),
            2);
}

TEST_F(SharedMemoryInputs, NamesAndCapsAreChecked) {
  auto server = StartServer({"--max-shared-memory-regions", "2", "--max-shared-memory-bytes", "3145728"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  Session a{"session-names-0123456789ab", *stub};
  TestRegion r1(1 << 20), r2(1 << 20), r3(4 << 20);
  struct Bad {
    std::string name, shm_name;
    int64_t size;
    grpc::StatusCode code;
  };
  const std::vector<Bad> bad = {
      {"x", "/../../etc/passwd", 1, grpc::StatusCode::INVALID_ARGUMENT},
      {"x", "etc", 1, grpc::StatusCode::INVALID_ARGUMENT},
      {"x", "/a/b", 1, grpc::StatusCode::INVALID_ARGUMENT},
      {"x", "/..", 1, grpc::StatusCode::INVALID_ARGUMENT},
      {"bad name!", r1.name(), 1, grpc::StatusCode::INVALID_ARGUMENT},
      {"x", r1.name(), 0, grpc::StatusCode::INVALID_ARGUMENT},
      {"x", r1.name(), (1 << 20) + 1, grpc::StatusCode::INVALID_ARGUMENT},  // larger than the object
      {"x", "/logprob-test-does-not-exist", 1, grpc::StatusCode::NOT_FOUND},
      {"x", "/logprob-" + std::to_string(server->pid()) + "-0", 1, grpc::StatusCode::PERMISSION_DENIED},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.shm_name + " as " + b.name);
    const grpc::Status s = a.Register(b.name, b.shm_name, b.size);
    EXPECT_EQ(s.error_code(), b.code) << s.error_message();
  }
  Session nokey{"", *stub};
  EXPECT_EQ(nokey.Register("x", r1.name(), 1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  Session shortkey{"short", *stub};
  EXPECT_EQ(shortkey.Register("x", r1.name(), 1).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Caps: 3 MiB and 2 regions in all, whoever registers.
  Session b{"session-caps-b-0123456789", *stub};
  EXPECT_EQ(a.Register("big", r3.name(), 4 << 20).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_TRUE(a.Register("one", r1.name(), 1 << 20).ok());
  ASSERT_TRUE(b.Register("two", r2.name(), 1 << 20).ok());
  const grpc::Status s = a.Register("three", r3.name(), 1 << 20);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("--max-shared-memory-regions"), std::string::npos) << s.error_message();
  ASSERT_TRUE(b.Unregister("two").ok());
  EXPECT_EQ(a.Register("three", r3.name(), 3 << 20).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "1 + 3 MiB is over 3 MiB";
  EXPECT_TRUE(a.Register("three", r3.name(), 2 << 20).ok());
}

TEST_F(SharedMemoryInputs, TruncatedRegionsGiveAClearErrorAndTheServerGoesOn) {
  // The slow request: 8192 rows against an F32 lm_head [32000, 1024]
  // (seconds of GEMM on 2 cores).
  HiddenWorkload work("shm_truncate", kV, kH, 21, 8192, 16);
  const std::string lm_head = F32LmHead(work.lm_head, "shm_truncate");
  auto server = StartServer({"--lm-head", lm_head, "--max-queue-delay", "10s"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  Session a{"session-truncate-0123456789", *stub};
  const GoldenCase g = LoadGolden("llama_vocab_bf16");
  v1::ScoreResponse inline_resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Score(&ctx, GoldenRequest(g), &inline_resp).ok());
  }
  const size_t size = 16 << 20;

  // Truncated before the request.
  {
    TestRegion region(size);
    ASSERT_TRUE(a.Register("before", region.name(), size).ok());
    v1::ScoreRequest req = GoldenRequest(g);
    region.Place(&req, "before");
    region.Truncate(0);
    v1::ScoreResponse resp;
    const grpc::Status s = a.Score(req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_NE(s.error_message().find("\"before\""), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("could not be read"), std::string::npos) << s.error_message();
  }

  // Truncated while the request waits in the queue behind a slow one: its
  // logits are read when its batch is planned, after the truncation.
  {
    TestRegion region(size);
    ASSERT_TRUE(a.Register("during", region.name(), size).ok());
    v1::ScoreRequest req = GoldenRequest(g);
    region.Place(&req, "during");
    auto slow = std::async(std::launch::async, [&] {
      grpc::ClientContext ctx;
      v1::ScoreResponse r;
      return stub->Score(&ctx, work.slow, &r);
    });
    // The slow request runs (not merely arrives: a call counts from before
    // its body is read), so what queues next is the request under test.
    EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_running_batches", 1));
    auto queued = std::async(std::launch::async, [&] {
      v1::ScoreResponse r;
      return a.Score(req, &r);
    });
    EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_queued_requests", 1));
    region.Truncate(4096);  // the integer tensors' copies were taken; the logits rows are gone
    const grpc::Status s = queued.get();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_NE(s.error_message().find("\"during\""), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("changed while the request was in flight"), std::string::npos)
        << s.error_message();
    EXPECT_TRUE(slow.get().ok());
  }

  // Batched: an inline request and two referencing the region (at
  // different offsets) queue behind a slow one and run as one worker batch
  // (ConcatJobs keeps each job's row source); each result is bitwise the
  // inline one.
  {
    TestRegion region(2 * size);
    ASSERT_TRUE(a.Register("batched", region.name(), 2 * size).ok());
    v1::ScoreRequest first = GoldenRequest(g);
    region.Place(&first, "batched");
    v1::ScoreRequest second = first;  // the same bytes again, `size` bytes further
    for (auto& t : *second.mutable_inputs()) {
      const int64_t at = t.shared_memory().offset() + static_cast<int64_t>(size);
      std::memcpy(region.data() + at, region.data() + t.shared_memory().offset(), t.shared_memory().byte_size());
      t.mutable_shared_memory()->set_offset(at);
    }
    const CommandResult before = ScrapeMetrics(metrics_port_);
    auto slow = std::async(std::launch::async, [&] {
      grpc::ClientContext ctx;
      v1::ScoreResponse r;
      return stub->Score(&ctx, work.slow, &r);
    });
    // The slow request runs (not merely arrives: a call counts from before
    // its body is read), so what queues next is the request under test.
    EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_running_batches", 1));
    std::vector<std::future<std::pair<grpc::Status, std::string>>> queued;
    for (const v1::ScoreRequest* r : {&first, &second}) {
      queued.push_back(std::async(std::launch::async, [&a, r] {
        v1::ScoreResponse resp;
        grpc::Status st = a.Score(*r, &resp);
        return std::make_pair(st, OutputBytes(resp));
      }));
    }
    queued.push_back(std::async(std::launch::async, [&] {
      grpc::ClientContext ctx;
      v1::ScoreResponse resp;
      grpc::Status st = stub->Score(&ctx, GoldenRequest(g), &resp);
      return std::make_pair(st, OutputBytes(resp));
    }));
    EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_queued_requests", 3));
    for (auto& q : queued) {
      const auto [st, bytes] = q.get();
      ASSERT_TRUE(st.ok()) << st.error_message();
      EXPECT_TRUE(bytes == OutputBytes(inline_resp)) << "batched shared-memory result differs from inline";
    }
    ASSERT_TRUE(slow.get().ok());
    const CommandResult after = ScrapeMetrics(metrics_port_);
    EXPECT_EQ(MetricSample(after.output, "logprob_batch_requests_count") -
                  MetricSample(before.output, "logprob_batch_requests_count"),
              2)
        << "the slow request's batch and one batch of the three";
  }

  // The server and its workers are fine.
  EXPECT_TRUE(server->Alive());
  grpc::ClientContext ctx;
  v1::ScoreResponse resp;
  ASSERT_TRUE(stub->Score(&ctx, GoldenRequest(g), &resp).ok());
  EXPECT_TRUE(OutputBytes(resp) == OutputBytes(inline_resp));
  std::filesystem::remove(lm_head);
}

TEST_F(SharedMemoryInputs, IdleSessionsLoseTheirRegions) {
  auto server = StartServer({"--shared-memory-idle-timeout", "300ms"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  TestRegion region(1 << 20);
  Session a{"session-idle-0123456789abc", *stub};
  ASSERT_TRUE(a.Register("r", region.name(), 1 << 20).ok());
  // The reaper removes it once the session has been idle for 300 ms
  // (observed on /metrics, which does not count as a call of the session).
  EXPECT_TRUE(WaitForMetric(metrics_port_, "logprob_shared_memory_regions", 0));
  EXPECT_TRUE(a.List().empty());
  v1::ScoreRequest req = GoldenRequest(LoadGolden("basic_f32"));
  region.Place(&req, "r");
  v1::ScoreResponse resp;
  EXPECT_EQ(a.Score(req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(SharedMemoryInputs, CliScoreAndBenchSendThroughARegion) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  const GoldenCase g = LoadGolden("sampling_f32");
  const std::string out = ::testing::TempDir() + "/shm_cli_out." + std::to_string(getpid()) + ".safetensors";
  const std::string client = BinDir() + "/logprob-client";
  const CommandResult score =
      RunCommand(client + " score --server " + server->address() + " --input " + GoldenDir() +
                 "/sampling_f32.safetensors --output " + out + " --shared-memory" + CliOptionFlags(g) + " 2>&1");
  ASSERT_EQ(score.code, 0) << score.output;
  auto got = ReadSafetensors(out);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(CompareOutputs(g.expected.tensors, got->tensors), "");
  std::filesystem::remove(out);
  const CommandResult bench = RunCommand(
      client + " bench --server " + server->address() +
      " --shared-memory --batch 2 --seq 64 --vocab 1000 --requests 5 --warmup 0 --no-echo --progress 0 2>&1");
  ASSERT_EQ(bench.code, 0) << bench.output;
  // Each command registered one region, and removed it when it exited.
  const CommandResult m = ScrapeMetrics(metrics_port_);
  ASSERT_EQ(m.code, 0) << m.output;
  EXPECT_EQ(MetricSample(m.output, R"(logprob_requests_total{code="OK",method="RegisterSharedMemory"})"), 2);
  EXPECT_EQ(MetricSample(m.output, R"(logprob_requests_total{code="OK",method="UnregisterSharedMemory"})"), 2);
  EXPECT_EQ(MetricSample(m.output, "logprob_shared_memory_regions"), 0);
  // The server has shared-memory inputs off: a clear error, exit 1.
  auto off = ServerProcess::Start(1, {"--shared-memory-inputs=false"});
  ASSERT_TRUE(off);
  const CommandResult refused = RunCommand(client + " score --server " + off->address() + " --input " + GoldenDir() +
                                           "/basic_f32.safetensors --output " + out + " --shared-memory 2>&1");
  EXPECT_EQ(refused.code, 1) << refused.output;
  EXPECT_NE(refused.output.find("shared-memory inputs off"), std::string::npos) << refused.output;
}

TEST_F(SharedMemoryInputs, DisabledByFlag) {
  auto server = StartServer({"--shared-memory-inputs=false"});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  EXPECT_FALSE(info.shared_memory_inputs());
  EXPECT_FALSE(client::SameSharedMemoryHost(info));
  TestRegion region(1 << 20);
  Session a{"session-off-0123456789abcd", *stub};
  EXPECT_EQ(a.Register("r", region.name(), 1 << 20).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(a.reason.load(), v1::SHARED_MEMORY_UNAVAILABLE);
  EXPECT_EQ(a.Unregister("r").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(a.reason.load(), v1::SHARED_MEMORY_UNAVAILABLE);
  v1::ScoreRequest req = GoldenRequest(LoadGolden("basic_f32"));
  region.Place(&req, "r");
  v1::ScoreResponse resp;
  EXPECT_EQ(a.Score(req, &resp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(a.reason.load(), v1::SHARED_MEMORY_UNAVAILABLE);
}

}  // namespace
}  // namespace logprob::testing
