// LmHeadUpdates without a server: the findings of fuzz_lm_head_update stay
// fixed (a server stopping with an update open; row ranges whose end does
// not fit in int64); rows from a source the front-end cannot read (a CUDA
// IPC reference) are staged by a (fake) worker at their byte offset and
// then count, hash and commit like bytes; without a worker that can, or
// when staging fails, they are refused and may be sent again; rows read
// with positioned reads land block by block from several threads.
#include "server/heads/lm_head_updates.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/confined_file.h"
#include "common/error_reason.h"
#include "common/finite_check.h"
#include "common/lm_head_source.h"
#include "common/lm_head_update_driver.h"
#include "common/positioned_io.h"
#include "common/safetensors.h"
#include "common/sha256.h"
#include "server/app/memory_bound.h"
#include "server/heads/lm_head_update_calls.h"
#include "server/heads/lm_heads.h"
#include "server/inputs/cuda_ipc_inputs.h"
#include "server/inputs/input_source.h"

namespace logprob {
namespace {

constexpr int64_t kV = 37, kH = 4;

class LmHeadUpdatesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = ::testing::TempDir() + "/lm_head_updates_test." + std::to_string(getpid());
    std::filesystem::create_directories(store_);
    LmHeadVersion first;
    first.head = "default";
    first.version = "initial";
    first.source.file = store_ + "/start.safetensors";  // never read by updates
    first.source.tensor = "lm_head.weight";
    first.source.dtype = v1::F32;
    first.source.vocab_size = kV;
    first.source.hidden_size = kH;
    ASSERT_TRUE(heads_.Add(first).ok());
  }
  void TearDown() override { std::filesystem::remove_all(store_); }

  using Stage = std::function<absl::Status(const internal::v1::LmHeadStage&)>;
  /// Updates of `heads` (default: heads_) whose workers load and drop
  /// (reported to `dropped` when given) and stage with `stage`.
  std::unique_ptr<LmHeadUpdates> Make(Stage stage = nullptr, LmHeadUpdateObservers observers = {},
                                      LmHeads* heads = nullptr, std::shared_ptr<LmHeadReleases> releases = nullptr,
                                      std::vector<std::string>* dropped = nullptr) {
    LmHeadUpdates::Options o;
    o.allowed = true;
    o.store_dir = store_;
    o.update_dir = update_dir_;
    if (timeout_.count() > 0) o.timeout = timeout_;
    o.store_files_per_head = store_files_;
    o.inputs = inputs_;
    LmHeadWorkers w;
    w.load = [](const internal::v1::LmHeadLoad&) -> absl::StatusOr<int64_t> { return 0; };
    w.serving = [](int64_t) { return true; };
    w.drop = [dropped](const internal::v1::LmHeadRef& ref) {
      if (dropped) dropped->push_back(ref.version());
      return true;
    };
    w.stage = std::move(stage);
    return std::make_unique<LmHeadUpdates>(
        o, heads ? heads : &heads_, releases ? releases : std::make_shared<LmHeadReleases>(), w, std::move(observers));
  }
  static v1::BeginLmHeadUpdateRequest Begin(const std::string& version) {
    v1::BeginLmHeadUpdateRequest b;
    b.set_head("default");
    b.set_version(version);
    b.set_vocab_size(kV);
    b.set_hidden_size(kH);
    b.set_dtype(v1::F32);
    return b;
  }
  /// The `n` bytes of weight in version `v`'s store file ("" and a failure
  /// when they cannot be read).
  static std::string StoredRows(const LmHeadVersion& v, size_t n) {
    std::string out(n, '\0');
    const int fd = open(v.source.file.c_str(), O_RDONLY);
    const bool read = fd >= 0 && PreadAll(fd, out.data(), n, v.source.data_offset);
    if (fd >= 0) close(fd);
    if (!read) ADD_FAILURE() << "cannot read " << n << " bytes of " << v.source.file;
    return read ? out : std::string();
  }
  /// Heads retaining `retain` versions, holding the fixture's first one
  /// (its file `start_file` when given), handing released versions to
  /// `releases` when given (as the server wires them).
  std::unique_ptr<LmHeads> RetainingHeads(int retain, std::shared_ptr<LmHeadReleases> releases = nullptr,
                                          const std::string& start_file = "") {
    LmHeads::Options ho;
    ho.retain = retain;
    if (releases) ho.on_release = [releases](const LmHeadVersion& v) { releases->Push(v); };
    auto heads = std::make_unique<LmHeads>(ho);
    LmHeadVersion first = *heads_.Bind("default", "").value();
    if (!start_file.empty()) first.source.file = start_file;
    EXPECT_TRUE(heads->Add(first).ok());
    return heads;
  }
  size_t StoreFiles() const {
    return static_cast<size_t>(std::distance(std::filesystem::directory_iterator(store_), {}));
  }

  std::string store_;
  std::string update_dir_;                           // --lm-head-update-dir of Make's updates ("": none)
  std::chrono::milliseconds timeout_{0};             // --lm-head-update-timeout of Make's updates (0: the default)
  int store_files_ = 0;                              // Options::store_files_per_head of Make's updates (0: no cap)
  InputResolver inputs_of_{InputResolverOptions{}};  // shared-memory inputs on, no CUDA IPC
  InputResolver* inputs_ = &inputs_of_;              // Options::inputs of Make's updates
  LmHeads heads_{LmHeads::Options{}};
};

TEST_F(LmHeadUpdatesTest, StoppingWithUpdatesOpenAbortsThemAndRemovesTheirFiles) {
  auto updates = Make();
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string rows(static_cast<size_t>(3 * kH * 4), '\1');
  ASSERT_TRUE(updates->PutRows(opened->update_id(), 0, 3, v1::F32, kH, *MemorySource(rows)).ok());
  EXPECT_GT(StoreFiles(), 0u);
  updates.reset();  // ended each open update through the map's own pointer (heap-use-after-free before)
  EXPECT_EQ(StoreFiles(), 0u);
  EXPECT_EQ(heads_.Bind("default", "").value()->version, "initial");
}

TEST_F(LmHeadUpdatesTest, RowRangesWhoseEndOverflowsAreInvalidArgument) {
  auto updates = Make();
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string none;
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min(), kMax = std::numeric_limits<int64_t>::max();
  for (const auto& [begin, rows] :
       {std::pair<int64_t, int64_t>{-2, kMin}, {kMax, kMax}, {5, kMax}, {kMax, 1}, {36, 2}, {37, 1}, {0, 0}}) {
    SCOPED_TRACE(std::to_string(begin) + " + " + std::to_string(rows));
    const auto put = updates->PutRows(opened->update_id(), begin, rows, v1::F32, kH, *MemorySource(none));
    EXPECT_EQ(put.status().code(), absl::StatusCode::kInvalidArgument) << put.status();
    EXPECT_NE(put.status().message().find("are not a non-empty range of the head's [0, 37)"), std::string::npos)
        << put.status();
  }
}

/// `rows` rows of kH F32 values, distinct per row and `salt`.
std::string Rows(int64_t first, int64_t rows, float salt) {
  std::vector<float> v(static_cast<size_t>(rows * kH));
  for (size_t i = 0; i < v.size(); ++i) v[i] = salt + static_cast<float>(first * kH + static_cast<int64_t>(i)) * 0.25f;
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

/// A fake of the workers' CUDA IPC staging: "GPU allocations" are host
/// strings by handle; stage() writes the referenced bytes into the file at
/// the offset as Worker.StageLmHeadRows does, and records each call.
struct FakeGpuWorker {
  std::map<std::string, std::string> allocations;  // handle -> bytes
  std::vector<internal::v1::LmHeadStage> calls;
  std::vector<absl::Status> fail;  // returned (front first) instead of copying
  absl::Status Stage(const internal::v1::LmHeadStage& s) {
    calls.push_back(s);
    if (!fail.empty()) {
      absl::Status st = fail.front();
      fail.erase(fail.begin());
      return st;
    }
    const std::string& alloc = allocations.at(s.source().handle());
    const int fd = open(s.file().c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError("no staged file");
    const bool ok = PwriteAll(fd, alloc.data() + s.source().offset(), static_cast<size_t>(s.source().byte_size()),
                              static_cast<uint64_t>(s.file_offset()));
    close(fd);
    return ok ? absl::OkStatus() : absl::InternalError("write failed");
  }
};

/// A CUDA IPC source of `rows` rows from `alloc` at byte `offset`, resolved
/// as the server resolves LmHeadRows.rows (a same-host server with CUDA
/// workers, a local peer).
std::shared_ptr<const InputSource> IpcRows(const std::string& handle, int64_t offset, int64_t rows) {
  v1::Tensor t;
  t.set_name("rows");
  t.set_dtype(v1::F32);
  t.add_shape(rows);
  t.add_shape(kH);
  t.mutable_cuda_ipc()->set_handle(handle);
  t.mutable_cuda_ipc()->set_offset(offset);
  t.mutable_cuda_ipc()->set_byte_size(rows * kH * 4);
  CudaIpcAvailability a;
  a.cuda_workers = a.same_host = a.one_pass = true;
  a.workers = 1;
  return ResolveCudaIpc(t, 0, a, "ipv4:127.0.0.1:1", "the rows").value();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST_F(LmHeadUpdatesTest, RowsTheFrontEndCannotReadAreStagedByAWorkerThenCountLikeBytes) {
  FakeGpuWorker gpu;
  const std::string handle(64, 'h');
  constexpr int64_t kAllocOffset = 64;
  const std::string ipc_rows = Rows(20, kV - 20, 1.0f);
  gpu.allocations[handle] = std::string(kAllocOffset, '\0') + ipc_rows + std::string(32, '\0');
  std::vector<int64_t> bytes_seen;
  LmHeadUpdateObservers observers;
  observers.on_bytes = [&](const std::string&, int64_t n) { bytes_seen.push_back(n); };
  auto updates = Make([&gpu](const internal::v1::LmHeadStage& s) { return gpu.Stage(s); }, observers);
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();

  const std::string host_rows = Rows(0, 20, 1.0f);
  ASSERT_TRUE(updates->PutRows(opened->update_id(), 0, 20, v1::F32, kH, *MemorySource(host_rows)).ok());
  auto put = updates->PutRows(opened->update_id(), 20, kV - 20, v1::F32, kH, *IpcRows(handle, kAllocOffset, kV - 20));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->rows_received(), kV);
  EXPECT_EQ(bytes_seen, (std::vector<int64_t>{20 * kH * 4, (kV - 20) * kH * 4}));

  // One stage call: the reference, the staged file, the rows' byte offset.
  ASSERT_EQ(gpu.calls.size(), 1u);
  const internal::v1::LmHeadStage& s = gpu.calls[0];
  EXPECT_EQ(s.source().handle(), handle);
  EXPECT_EQ(s.source().offset(), kAllocOffset);
  EXPECT_EQ(s.source().byte_size(), (kV - 20) * kH * 4);
  EXPECT_NE(s.file().find(store_), std::string::npos) << s.file();
  EXPECT_NE(s.file().find(".partial"), std::string::npos) << s.file();

  auto committed = updates->Commit(opened->update_id());
  ASSERT_TRUE(committed.ok()) << committed.status();
  const std::string all = host_rows + ipc_rows;
  EXPECT_EQ(committed->version(), "v1");
  // Without an announced sha256 the digest is computed after the commit.
  EXPECT_EQ(heads_.Find("default", committed->version())->sha256.get(), Sha256Hex(all));
  const auto v = heads_.Find("default", "v1");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(s.file_offset(), static_cast<int64_t>(v->source.data_offset) + 20 * kH * 4);
  const std::string file = ReadAll(v->source.file);
  ASSERT_EQ(file.size(), v->source.data_offset + all.size());
  EXPECT_EQ(file.substr(v->source.data_offset), all);
  EXPECT_EQ(heads_.Bind("default", "").value()->version, "v1");
}

TEST_F(LmHeadUpdatesTest, WithoutAWorkerThatCanStageThemIpcRowsAreRefusedAndNothingChanges) {
  auto updates = Make();  // no stage callback
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  auto put = updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *IpcRows(std::string(64, 'h'), 0, kV));
  EXPECT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition) << put.status();
  EXPECT_EQ(ReasonOf(put.status()), v1::CUDA_IPC_UNAVAILABLE) << put.status();
  EXPECT_NE(put.status().message().find("send the rows as bytes (in pieces or through shared memory)"),
            std::string::npos)
      << put.status();
  // The range was not claimed: the same rows come as bytes, and commit.
  const std::string rows = Rows(0, kV, 2.0f);
  put = updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->rows_received(), kV);
  auto committed = updates->Commit(opened->update_id());
  ASSERT_TRUE(committed.ok()) << committed.status();
  // Without an announced sha256 the digest is computed after the commit.
  EXPECT_EQ(heads_.Find("default", committed->version())->sha256.get(), Sha256Hex(rows));
}

TEST_F(LmHeadUpdatesTest, AFailedStageIsAClearErrorAndTheRowsMayComeAgain) {
  FakeGpuWorker gpu;
  const std::string handle(64, 'g');
  const std::string rows = Rows(0, kV, 3.0f);
  gpu.allocations[handle] = rows;
  // The worker's errors as the pool passes them on, with their reasons.
  gpu.fail = {
      WithReason(absl::FailedPreconditionError("cudaIpcOpenMemHandle: invalid argument"), v1::CUDA_IPC_UNAVAILABLE),
      absl::FailedPreconditionError("worker rank 1: the staged file is gone"),
      absl::InternalError("copying bytes [0, 592) of 592 from the device: an illegal memory access")};
  auto updates = Make([&gpu](const internal::v1::LmHeadStage& s) { return gpu.Stage(s); });
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();

  // The worker cannot open the handle: the client should send bytes.
  auto put = updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *IpcRows(handle, 0, kV));
  EXPECT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition) << put.status();
  EXPECT_EQ(ReasonOf(put.status()), v1::CUDA_IPC_UNAVAILABLE) << put.status();
  EXPECT_NE(put.status().message().find("rows [0, 37): copying them from the client's CUDA IPC memory on a worker "
                                        "failed: cudaIpcOpenMemHandle: invalid argument"),
            std::string::npos)
      << put.status();
  // Another FAILED_PRECONDITION of the worker is not relabelled: bytes
  // would not help.
  put = updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *IpcRows(handle, 0, kV));
  EXPECT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition) << put.status();
  EXPECT_EQ(ReasonOf(put.status()), v1::ERROR_REASON_UNSPECIFIED) << put.status();
  // A copy that fails on the device: its own code, no reason.
  put = updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *IpcRows(handle, 0, kV));
  EXPECT_EQ(put.status().code(), absl::StatusCode::kInternal) << put.status();
  EXPECT_EQ(ReasonOf(put.status()), v1::ERROR_REASON_UNSPECIFIED) << put.status();
  EXPECT_NE(put.status().message().find("an illegal memory access"), std::string::npos) << put.status();
  // Neither counted: committing now names the missing rows.
  auto early = updates->Commit(opened->update_id());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  EXPECT_NE(early.status().message().find("37 rows missing"), std::string::npos) << early.status();

  // Sent again, they stage, count and commit (hashed once).
  put = updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *IpcRows(handle, 0, kV));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(gpu.calls.size(), 4u);
  auto committed = updates->Commit(opened->update_id());
  ASSERT_TRUE(committed.ok()) << committed.status();
  // Without an announced sha256 the digest is computed after the commit.
  EXPECT_EQ(heads_.Find("default", committed->version())->sha256.get(), Sha256Hex(rows));
}

TEST_F(LmHeadUpdatesTest, IpcRowsGoThroughTheSameChecksAsBytes) {
  FakeGpuWorker gpu;
  const std::string handle(64, 'k');
  gpu.allocations[handle] = Rows(0, kV, 4.0f);
  auto updates = Make([&gpu](const internal::v1::LmHeadStage& s) { return gpu.Stage(s); });
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->update_id();
  // Outside [0, V), a dtype or H other than the update's, a size that is not the rows'.
  EXPECT_EQ(updates->PutRows(id, 30, 10, v1::F32, kH, *IpcRows(handle, 0, 10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(updates->PutRows(id, 0, 10, v1::BF16, kH, *IpcRows(handle, 0, 10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(updates->PutRows(id, 0, 5, v1::F32, kH, *IpcRows(handle, 0, 10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(updates->PutRows("no-such-update", 0, 10, v1::F32, kH, *IpcRows(handle, 0, 10)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(gpu.calls.empty()) << "nothing refused reaches a worker";
  // Exactly once: rows given by IPC cannot come again as bytes.
  ASSERT_TRUE(updates->PutRows(id, 0, 10, v1::F32, kH, *IpcRows(handle, 0, 10)).ok());
  const std::string again = Rows(0, 10, 4.0f);
  EXPECT_EQ(updates->PutRows(id, 5, 10, v1::F32, kH, *MemorySource(again)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu.calls.size(), 1u);
}

}  // namespace
TEST_F(LmHeadUpdatesTest, AReleasedVersionsFileTakesTheNextUpdateAndDigestsComeAfterOrAtTheCommit) {
  // Heads that hand released versions to the updates (as the server wires them).
  auto releases = std::make_shared<LmHeadReleases>();
  const std::unique_ptr<LmHeads> heads_owner = RetainingHeads(1, releases);
  LmHeads& heads = *heads_owner;
  std::vector<std::string> dropped;
  const std::unique_ptr<LmHeadUpdates> made = Make(nullptr, {}, &heads, releases, &dropped);
  LmHeadUpdates& updates = *made;
  auto inode = [](const std::string& path) {
    struct stat st {};
    return stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
  };
  auto commit = [&](const std::string& version, const std::string& rows, const std::string& sha) {
    v1::BeginLmHeadUpdateRequest b = Begin(version);
    b.set_sha256(sha);
    auto opened = updates.Begin(b);
    EXPECT_TRUE(opened.ok()) << opened.status();
    EXPECT_TRUE(updates.PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows)).ok());
    auto committed = updates.Commit(opened->update_id());
    EXPECT_TRUE(committed.ok()) << committed.status();
    return committed.ok() ? *committed : v1::LmHeadInfo();
  };

  // No sha256 announced: the commit does not wait for the digest; it comes.
  const std::string rows1 = Rows(0, kV, 1.0f), rows2 = Rows(0, kV, 2.0f), rows3 = Rows(0, kV, 3.0f);
  commit("v1", rows1, "");
  ino_t v1_inode = 0;
  {
    const auto v1 = heads.Find("default", "v1");  // holds v1 while in scope
    ASSERT_NE(v1, nullptr);
    EXPECT_EQ(v1->sha256.get(), Sha256Hex(rows1));
    v1_inode = inode(v1->source.file);
  }
  ASSERT_NE(v1_inode, 0u);
  // Announced: checked before the commit, and listed at once.
  EXPECT_EQ(commit("v2", rows2, Sha256Hex(rows2)).sha256(), Sha256Hex(rows2));
  // v1 left at v2's commit: the next update drops it and writes into its file.
  auto opened = updates.Begin(Begin("v3"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_NE(std::find(dropped.begin(), dropped.end(), "v1"), dropped.end());
  std::string partial;
  for (const auto& e : std::filesystem::directory_iterator(store_))
    if (e.path().string().find(".partial") != std::string::npos) partial = e.path().string();
  EXPECT_EQ(inode(partial), v1_inode) << partial;
  ASSERT_TRUE(updates.PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows3)).ok());
  ASSERT_TRUE(updates.Commit(opened->update_id()).ok());
  const auto v3 = heads.Find("default", "v3");
  ASSERT_NE(v3, nullptr);
  EXPECT_EQ(inode(v3->source.file), v1_inode);
  // Every byte of the reused file is v3's: the header, then rows3 exactly.
  EXPECT_EQ(std::filesystem::file_size(v3->source.file), v3->source.data_offset + rows3.size());
  EXPECT_EQ(v3->source.data_offset % 4096, 0u) << "the weight starts at a page boundary";
  EXPECT_EQ(StoredRows(*v3, rows3.size()), rows3);
  EXPECT_EQ(v3->sha256.get(), Sha256Hex(rows3));
  auto resolved = ResolveLmHead(v3->source.file);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->data_offset, v3->source.data_offset);

  // Back to back, some pinned by a "request" across the next commit: every
  // committed file holds exactly its rows, and the store keeps at most
  // retained + staged + two spares + the pinned ones.
  std::shared_ptr<const LmHeadVersion> pinned;
  for (int i = 4; i < 12; ++i) {
    const std::string version = "v" + std::to_string(i), rows = Rows(0, kV, static_cast<float>(i));
    commit(version, rows, "");
    const auto v = heads.Find("default", version);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(StoredRows(*v, rows.size()), rows) << version;
    EXPECT_EQ(v->sha256.get(), Sha256Hex(rows)) << version;
    pinned = i % 3 == 0 ? v : nullptr;  // held across the next commit, then let go
    EXPECT_LE(StoreFiles(), 5u) << version;
  }
}

TEST_F(LmHeadUpdatesTest, AVersionNameIsTakenForTheLifeOfItsHeadAndReleasesDropOnlyTheirOwnIdentity) {
  // Issue 31's first finding: --lm-head-retain 1; commit v2; a request
  // holds v2; commit v3; v2 again with other bytes must be refused, and
  // the release of the held v2 must drop that identity only.
  auto releases = std::make_shared<LmHeadReleases>();
  LmHeads::Options ho;
  ho.retain = 1;
  ho.on_release = [releases](const LmHeadVersion& v) { releases->Push(v); };
  LmHeads heads(ho);
  ASSERT_TRUE(heads.Add(*heads_.Bind("default", "").value()).ok());
  std::vector<internal::v1::LmHeadRef> dropped;
  LmHeadUpdates::Options o;
  o.allowed = true;
  o.store_dir = store_;
  LmHeadWorkers w;
  w.load = [](const internal::v1::LmHeadLoad&) -> absl::StatusOr<int64_t> { return 0; };
  w.serving = [](int64_t) { return true; };
  w.drop = [&dropped](const internal::v1::LmHeadRef& ref) {
    dropped.push_back(ref);
    return true;
  };
  LmHeadUpdates updates(o, &heads, releases, w);
  auto commit = [&](const std::string& version, const std::string& rows) {
    v1::BeginLmHeadUpdateRequest b = Begin(version);
    b.set_sha256(Sha256Hex(rows));
    auto opened = updates.Begin(b);
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return;
    EXPECT_TRUE(updates.PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows)).ok());
    auto committed = updates.Commit(opened->update_id());
    EXPECT_TRUE(committed.ok()) << committed.status();
  };
  const std::string rows2 = Rows(0, kV, 2.0f), rows3 = Rows(0, kV, 3.0f), other = Rows(0, kV, 9.0f);
  commit("v2", rows2);
  std::shared_ptr<const LmHeadVersion> request = heads.Bind("default", "").value();  // a long request on v2
  ASSERT_EQ(request->version, "v2");
  commit("v3", rows3);
  const std::shared_ptr<const LmHeadVersion> v3 = heads.Bind("default", "").value();
  ASSERT_EQ(v3->version, "v3");
  EXPECT_NE(v3->serial, request->serial);
  EXPECT_NE(v3->serial, 0u);

  // v2 with other bytes, with or without a sha256: refused while a request holds it.
  v1::BeginLmHeadUpdateRequest again = Begin("v2");
  again.set_sha256(Sha256Hex(other));
  auto refused = updates.Begin(again);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  EXPECT_NE(refused.status().message().find("v2"), std::string::npos) << refused.status();
  EXPECT_EQ(updates.Begin(Begin("v2")).status().code(), absl::StatusCode::kAlreadyExists);
  // The same bytes again: the idempotent no-op.
  again.set_sha256(Sha256Hex(rows2));
  auto same = updates.Begin(again);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->already_committed());

  // The request ends: its v2 (serial and all) is dropped, v3 is not.
  const uint64_t v2_serial = request->serial;
  request.reset();
  auto v4 = updates.Begin(Begin("v4"));  // drops what was released
  ASSERT_TRUE(v4.ok()) << v4.status();
  ASSERT_EQ(updates.Abort(v4->update_id()).status(), absl::OkStatus());
  ASSERT_FALSE(dropped.empty());
  for (const auto& ref : dropped) EXPECT_NE(ref.serial(), v3->serial) << ref.version();
  EXPECT_TRUE(std::any_of(dropped.begin(), dropped.end(),
                          [&](const auto& r) { return r.version() == "v2" && r.serial() == v2_serial; }));
  // Released now, the name stays taken.
  again.set_sha256(Sha256Hex(other));
  EXPECT_EQ(updates.Begin(again).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(heads.Bind("default", "").value()->version, "v3");
}

TEST_F(LmHeadUpdatesTest, AFrozenHeadRefusesUpdatesNamingTheFlagAndIsListedFrozen) {
  LmHeads::Options ho;
  ho.frozen = {"default"};
  LmHeads heads(ho);
  ASSERT_TRUE(heads.Add(*heads_.Bind("default", "").value()).ok());
  const std::unique_ptr<LmHeadUpdates> updates = Make(nullptr, {}, &heads);
  const absl::Status st = updates->Begin(Begin("v2")).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("--lm-head-frozen"), std::string::npos) << st;
  ASSERT_EQ(heads.List().size(), 1u);
  EXPECT_TRUE(heads.List()[0].frozen());
  EXPECT_EQ(heads.List()[0].version(), "initial");
  EXPECT_FALSE(heads_.List()[0].frozen());
  // Not frozen: the same update opens.
  auto opened = Make()->Begin(Begin("v2"));
  EXPECT_TRUE(opened.ok()) << opened.status();
}

TEST_F(LmHeadUpdatesTest, ACommitOfATakenVersionNameIsRefusedUnderTheLock) {
  LmHeadVersion v = *heads_.Bind("default", "").value();
  v.serial = heads_.NewSerial();
  v.version = "v2";
  ASSERT_TRUE(heads_.Commit(v).ok());
  v.serial = heads_.NewSerial();
  v.source.file = store_ + "/other.safetensors";
  EXPECT_EQ(heads_.Commit(v).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(heads_.List()[0].retained_versions_size(), 1);
}

TEST_F(LmHeadUpdatesTest, ConcurrentBeginsOfOneVersionCommitItOnce) {
  const std::unique_ptr<LmHeads> heads_owner = RetainingHeads(64);
  LmHeads& heads = *heads_owner;
  const std::unique_ptr<LmHeadUpdates> updates = Make(nullptr, {}, &heads);
  constexpr int kThreads = 4, kRounds = 12;
  for (int round = 0; round < kRounds; ++round) {
    const std::string version = "r" + std::to_string(round);
    std::atomic<int> committed{0}, refused{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        const std::string rows = Rows(0, kV, static_cast<float>(100 * round + t));  // each its own bytes
        for (;;) {
          auto opened = updates->Begin(Begin(version));
          if (opened.status().code() == absl::StatusCode::kFailedPrecondition) {
            std::this_thread::yield();  // another thread's update is open: try again
            continue;
          }
          if (!opened.ok()) {
            EXPECT_EQ(opened.status().code(), absl::StatusCode::kAlreadyExists) << opened.status();
            ++refused;
            return;
          }
          EXPECT_TRUE(updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows)).ok());
          auto c = updates->Commit(opened->update_id());
          if (c.ok()) {
            ++committed;
          } else {
            EXPECT_EQ(c.status().code(), absl::StatusCode::kAlreadyExists) << c.status();
            ++refused;
          }
          return;
        }
      });
    for (std::thread& th : threads) th.join();
    EXPECT_EQ(committed.load(), 1) << version;
    EXPECT_EQ(refused.load(), kThreads - 1) << version;
  }
  const auto info = heads.List()[0];
  std::map<std::string, int> seen;
  for (const auto& v : info.retained_versions()) ++seen[v];
  for (const auto& [v, n] : seen) EXPECT_EQ(n, 1) << v;
  EXPECT_EQ(info.retained_versions_size(), kRounds + 1);
}

TEST_F(LmHeadUpdatesTest, VersionsPinnedByRequestsInFlightKeepTheStoreWithinItsPartOfTheBound) {
  // --lm-head-retain 1: the bound counts 4 store files for the head. The
  // start-up version's file is outside the store, as at start-up.
  auto releases = std::make_shared<LmHeadReleases>();
  const std::unique_ptr<LmHeads> heads_owner =
      RetainingHeads(1, releases, ::testing::TempDir() + "/start-checkpoint.safetensors");
  LmHeads& heads = *heads_owner;
  store_files_ = LmHeadStoreFiles(1);
  ASSERT_EQ(store_files_, 4);
  const std::unique_ptr<LmHeadUpdates> updates = Make(nullptr, {}, &heads, releases);
  auto begin_put_commit = [&](const std::string& version) -> absl::Status {
    auto opened = updates->Begin(Begin(version));
    if (!opened.ok()) return opened.status();
    EXPECT_TRUE(updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(Rows(0, kV, 1.0f))).ok());
    return updates->Commit(opened->update_id()).status();
  };
  // 12 commits, each with a "request" queued on the version before it (a
  // pin held until the end): the store never holds more than its part.
  std::vector<std::shared_ptr<const LmHeadVersion>> queued;
  int committed = 0, refused = 0;
  for (int i = 0; i < 12; ++i) {
    queued.push_back(heads.Bind("default", "").value());
    const absl::Status st = begin_put_commit("q" + std::to_string(i));
    if (st.ok()) {
      ++committed;
    } else {
      EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
      EXPECT_NE(st.message().find("pinned by requests in flight"), absl::string_view::npos) << st;
      ++refused;
    }
    EXPECT_LE(StoreFiles(), 4u) << "after commit " << i;
  }
  // The start-up version is not a store file: 4 updates fit, pinned.
  EXPECT_EQ(committed, 4);
  EXPECT_EQ(refused, 8);
  // The requests answered, their versions go: the next update is accepted.
  queued.clear();
  ASSERT_TRUE(begin_put_commit("after").ok());
  EXPECT_LE(StoreFiles(), 4u);
}

TEST_F(LmHeadUpdatesTest, RanksPushingTheSameWeightAsOneVersionUploadItOnceAndAllGetIt) {
  const std::unique_ptr<LmHeads> heads_owner = RetainingHeads(64);
  LmHeads& heads = *heads_owner;
  const std::unique_ptr<LmHeadUpdates> updates = Make(nullptr, {}, &heads);
  constexpr int kThreads = 4, kRounds = 8;
  for (int round = 0; round < kRounds; ++round) {
    const std::string version = "step-" + std::to_string(round);
    const std::string rows = Rows(0, kV, static_cast<float>(round));  // every rank: the same bytes
    std::atomic<int> uploads{0}, joined{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        v1::BeginLmHeadUpdateRequest b = Begin(version);
        b.set_sha256(Sha256Hex(rows));
        b.set_client_token(absl::StrCat("rank-token-0000000", t));  // each rank its own
        auto opened = updates->Begin(b);
        ASSERT_TRUE(opened.ok()) << "rank " << t << ": " << opened.status();
        if (opened->already_committed()) {
          ++joined;
          return;
        }
        ++uploads;
        ASSERT_TRUE(updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows)).ok());
        ASSERT_TRUE(updates->Commit(opened->update_id()).ok());
      });
    for (std::thread& th : threads) th.join();
    EXPECT_EQ(uploads.load(), 1) << version;
    EXPECT_EQ(joined.load(), kThreads - 1) << version;
    EXPECT_EQ(heads.Find("default", version)->sha256.get(), Sha256Hex(rows)) << version;
  }
  EXPECT_EQ(heads.List()[0].retained_versions_size(), kRounds + 1);
}

TEST_F(LmHeadUpdatesTest, ABeginWaitingForAnotherRanksUploadAnswersItsOutcome) {
  const std::unique_ptr<LmHeadUpdates> updates = Make();
  const std::string rows = Rows(0, kV, 7.0f);
  v1::BeginLmHeadUpdateRequest first = Begin("v2");
  first.set_sha256(Sha256Hex(rows));
  first.set_client_token("first-rank-token-0000");
  v1::BeginLmHeadUpdateRequest second = first;
  second.set_client_token("second-rank-token-000");
  auto opened = updates->Begin(first);
  ASSERT_TRUE(opened.ok()) << opened.status();
  // It waits for the open update (not FAILED_PRECONDITION), up to its deadline.
  auto late = updates->Begin(second, absl::Now());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  // Other bytes under the same name are still refused at once.
  v1::BeginLmHeadUpdateRequest other = second;
  other.set_sha256(Sha256Hex(Rows(0, kV, 8.0f)));
  EXPECT_EQ(updates->Begin(other).status().code(), absl::StatusCode::kFailedPrecondition);
  // The opener aborts: the waiting rank opens the update itself.
  std::thread aborter([&] { ASSERT_TRUE(updates->Abort(opened->update_id()).ok()); });
  auto own = updates->Begin(second);
  aborter.join();
  ASSERT_TRUE(own.ok()) << own.status();
  ASSERT_FALSE(own->already_committed());
  ASSERT_NE(own->update_id(), opened->update_id());
  // Its commit answers the first rank's retry with already_committed.
  ASSERT_TRUE(updates->PutRows(own->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows)).ok());
  std::thread committer([&] { ASSERT_TRUE(updates->Commit(own->update_id()).ok()); });
  first.set_client_token("first-rank-token-0001");
  auto after = updates->Begin(first);
  committer.join();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(after->already_committed());
}

TEST_F(LmHeadUpdatesTest, AnUpdateBelongsToItsOpenerAndABeginRetriedWithItsTokenGetsTheSameUpdate) {
  const std::unique_ptr<LmHeadUpdates> updates = Make();
  v1::BeginLmHeadUpdateRequest b = Begin("v2");
  b.set_client_token("0123456789abcdef0123456789abcdef");
  auto opened = updates->Begin(b);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->update_id();
  EXPECT_EQ(id.size(), 32u) << "128 bits in hex";
  EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
  // The opener's retry (its first answer lost): the same update.
  auto retried = updates->Begin(b);
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->update_id(), id);
  // Anyone else: the head is busy, and the message does not hand out the id.
  for (const std::string& token : {std::string(), std::string("another-client-token-0000")}) {
    v1::BeginLmHeadUpdateRequest other = b;
    other.set_client_token(token);
    auto refused = updates->Begin(other);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_EQ(refused.status().message().find(id), std::string::npos) << refused.status();
    EXPECT_NE(refused.status().message().find("\"v2\""), std::string::npos) << refused.status();
  }
  b.set_client_token("short");
  EXPECT_EQ(updates->Begin(b).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(updates->Abort(id).ok());
}

TEST_F(LmHeadUpdatesTest, ACommitRetriedAfterTheUpdateEndedAnswersItsOutcome) {
  const std::unique_ptr<LmHeadUpdates> updates = Make();
  const std::string rows = Rows(0, kV, 4.0f);
  // Committed: the retry (first answer lost) is OK with the same info.
  auto opened = updates->Begin(Begin("v2"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_TRUE(updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows)).ok());
  auto first = updates->Commit(opened->update_id());
  ASSERT_TRUE(first.ok()) << first.status();
  auto again = updates->Commit(opened->update_id());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->version(), "v2");
  EXPECT_EQ(again->name(), "default");
  // A later commit does not change what the first one answers.
  auto v3 = updates->Begin(Begin("v3"));
  ASSERT_TRUE(v3.ok()) << v3.status();
  ASSERT_TRUE(updates->PutRows(v3->update_id(), 0, kV, v1::F32, kH, *MemorySource(Rows(0, kV, 5.0f))).ok());
  ASSERT_TRUE(updates->Commit(v3->update_id()).ok());
  EXPECT_EQ(updates->Commit(opened->update_id())->version(), "v2");
  // A sha256 mismatch: every retry gets that error, not NOT_FOUND.
  v1::BeginLmHeadUpdateRequest bad = Begin("v4");
  bad.set_sha256(std::string(64, 'a'));
  auto wrong = updates->Begin(bad);
  ASSERT_TRUE(wrong.ok()) << wrong.status();
  ASSERT_TRUE(updates->PutRows(wrong->update_id(), 0, kV, v1::F32, kH, *MemorySource(rows)).ok());
  EXPECT_EQ(updates->Commit(wrong->update_id()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(updates->Commit(wrong->update_id()).status().code(), absl::StatusCode::kInvalidArgument);
  // Aborted by its client: ABORTED naming why.
  auto aborted = updates->Begin(Begin("v5"));
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  ASSERT_TRUE(updates->Abort(aborted->update_id()).ok());
  const absl::Status st = updates->Commit(aborted->update_id()).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_NE(st.message().find("aborted it"), std::string::npos) << st;
  // Never opened: NOT_FOUND.
  EXPECT_EQ(updates->Commit("0123").status().code(), absl::StatusCode::kNotFound);
}

/// The update core as the driver's calls, losing the answer of the calls
/// listed in `lose` after the core carried them out (UNAVAILABLE, as a
/// connection that broke after the server acted), or refusing them before
/// (`refuse`); each step's calls counted.
class LossyCalls final : public LmHeadUpdateCalls {
 public:
  explicit LossyCalls(LmHeadUpdates& updates) : real_(updates) {}
  std::set<std::string> lose, refuse;  // "begin", "put N" (N: the put's row_begin), "commit"
  std::map<std::string, int> calls;    // step -> calls
  std::vector<std::string> tokens;     // each Begin's client_token
  std::vector<std::string> aborted;    // Abort's update ids

  absl::StatusOr<v1::LmHeadUpdate> Begin(const v1::BeginLmHeadUpdateRequest& request) override {
    tokens.push_back(request.client_token());
    return Step("begin", [&] { return real_.Begin(request); });
  }
  absl::StatusOr<v1::LmHeadUpdate> Put(const std::string& id, const v1::BeginLmHeadUpdateRequest& begin, int64_t r0,
                                       int64_t r1, const LmHeadRowSource& rows) override {
    return Step("put " + std::to_string(r0), [&] { return real_.Put(id, begin, r0, r1, rows); });
  }
  absl::StatusOr<v1::LmHeadInfo> Commit(const std::string& id) override {
    return Step("commit", [&] { return real_.Commit(id); });
  }
  absl::Status Abort(const std::string& id) override {
    aborted.push_back(id);
    return real_.Abort(id);
  }

 private:
  template <typename Call>
  auto Step(const std::string& step, Call call) -> decltype(call()) {
    ++calls[step];
    if (refuse.erase(step)) return absl::UnavailableError("refused: " + step);
    auto result = call();
    if (result.ok() && lose.erase(step)) return absl::UnavailableError("answer lost: " + step);
    return result;
  }
  InProcessLmHeadUpdateCalls real_;
};

/// A source of `bytes` ([kV, kH] F32 rows); a read of rows from `fail_from` on fails (DATA_LOSS).
LmHeadRowSource SourceOf(const std::string& bytes, int64_t fail_from = kV) {
  LmHeadRowSource s;
  s.read = [&bytes, fail_from](int64_t r0, int64_t r1, char* dst, const std::function<void(int64_t)>&) {
    if (r1 > fail_from) return absl::DataLossError("the checkpoint is cut short");
    std::memcpy(dst, bytes.data() + r0 * kH * 4, static_cast<size_t>((r1 - r0) * kH * 4));
    return absl::OkStatus();
  };
  return s;
}

// Without the app's resolver nobody resolves rows given by reference.
TEST_F(LmHeadUpdatesTest, RowsByReferenceNeedAResolver) {
  inputs_ = nullptr;
  const std::unique_ptr<LmHeadUpdates> updates = Make();
  auto opened = updates->Begin(Begin("v2"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  v1::LmHeadRows referenced;
  referenced.set_update_id(opened->update_id());
  v1::Tensor* t = referenced.mutable_rows();
  t->set_dtype(v1::F32);
  t->add_shape(kV);
  t->add_shape(kH);
  t->mutable_shared_memory()->set_region("r");
  const absl::Status st = updates->Put(referenced).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("cannot be resolved"), std::string::npos) << st;
}

// The driver shared by logprob-client and peer sync: each step whose
// answer is lost (the server acted) is sent again and lands once: the
// same client_token opens the same update, a put re-sent with the same
// bytes is taken, a commit re-sent answers its outcome.
TEST_F(LmHeadUpdatesTest, TheUpdateDriverRetriesEveryStepWhoseAnswerWasLostAndCommitsTheRowsOnce) {
  const std::unique_ptr<LmHeadUpdates> updates = Make();
  LossyCalls calls(*updates);
  calls.lose = {"begin", "put 10", "commit"};
  calls.refuse = {"put 20"};
  const std::string rows = Rows(0, kV, 7.0f);
  LmHeadUpdateDriverOptions options;
  options.rows_per_put = 10;
  options.backoff = std::chrono::milliseconds(1);
  std::vector<int64_t> progress;
  options.on_put = [&](const v1::LmHeadUpdate& u) { progress.push_back(u.rows_received()); };
  auto outcome = DriveLmHeadUpdate(calls, Begin("v2"), SourceOf(rows), options);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_FALSE(outcome->already_committed);
  EXPECT_EQ(outcome->committed.version(), "v2");
  EXPECT_EQ(calls.calls, (std::map<std::string, int>{
                             {"begin", 2}, {"put 0", 1}, {"put 10", 2}, {"put 20", 2}, {"put 30", 1}, {"commit", 2}}));
  ASSERT_EQ(calls.tokens.size(), 2u);
  EXPECT_EQ(calls.tokens[0].size(), 32u) << "a random client_token";
  EXPECT_EQ(calls.tokens[1], calls.tokens[0]) << "the retried Begin repeats it";
  EXPECT_EQ(progress, (std::vector<int64_t>{10, 20, 30, 37}));
  EXPECT_TRUE(calls.aborted.empty());
  const auto v2 = heads_.Find("default", "v2");
  ASSERT_NE(v2, nullptr);
  EXPECT_EQ(StoredRows(*v2, rows.size()), rows);

  // The same version again with its sha256: nothing is sent.
  v1::BeginLmHeadUpdateRequest again = Begin("v2");
  again.set_sha256(Sha256Hex(rows));
  EXPECT_EQ(v2->sha256.get(), again.sha256());
  LossyCalls second(*updates);
  auto noop = DriveLmHeadUpdate(second, again, SourceOf(rows), options);
  ASSERT_TRUE(noop.ok()) << noop.status();
  EXPECT_TRUE(noop->already_committed);
  EXPECT_EQ(second.calls, (std::map<std::string, int>{{"begin", 1}}));
}

// A step that fails for good ends the update: it is aborted (the head
// keeps its version and can take the next update), and the error names the
// step. A stream read once is not put again.
TEST_F(LmHeadUpdatesTest, TheUpdateDriverAbortsOnAFailedStepAndNamesIt) {
  const std::unique_ptr<LmHeadUpdates> updates = Make();
  const std::string rows = Rows(0, kV, 9.0f);
  LmHeadUpdateDriverOptions options;
  options.rows_per_put = 10;
  options.backoff = std::chrono::milliseconds(1);
  {
    LossyCalls calls(*updates);
    auto failed = DriveLmHeadUpdate(calls, Begin("v2"), SourceOf(rows, /*fail_from=*/15), options);
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss) << failed.status();
    EXPECT_EQ(failed.status().message(), "PutLmHeadRows rows [10, 20): the checkpoint is cut short");
    EXPECT_EQ(calls.aborted.size(), 1u);
  }
  {
    LossyCalls calls(*updates);
    calls.refuse = {"put 0"};
    LmHeadRowSource once = SourceOf(rows);
    once.rereadable = false;
    auto failed = DriveLmHeadUpdate(calls, Begin("v2"), once, options);
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
    EXPECT_EQ(calls.calls["put 0"], 1);
    EXPECT_EQ(calls.aborted.size(), 1u);
  }
  {
    LossyCalls calls(*updates);
    v1::BeginLmHeadUpdateRequest wrong = Begin("v2");
    wrong.set_sha256(std::string(64, 'a'));
    auto failed = DriveLmHeadUpdate(calls, wrong, SourceOf(rows), options);
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument) << failed.status();
    EXPECT_TRUE(absl::StartsWith(failed.status().message(), "CommitLmHeadUpdate: ")) << failed.status();
  }
  EXPECT_EQ(heads_.Find("default", "v2"), nullptr);
  LossyCalls calls(*updates);
  auto next = DriveLmHeadUpdate(calls, Begin("v2"), SourceOf(rows), options);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(calls.calls["begin"], 1) << "no update was left open";
}

namespace {

/// Bytes read with Read only (as a client's region or a checkpoint: no
/// memory()), from `data`; a Read that touches byte `fail_at` fails.
class ReadOnlySource final : public InputSource {
 public:
  explicit ReadOnlySource(std::string data, int64_t fail_at = -1)
      : InputSource(InputKind::kSharedMemory, static_cast<int64_t>(data.size())),
        data_(std::move(data)),
        fail_at_(fail_at) {}
  bool Read(int64_t offset, size_t n, char* dst) const override {
    reads_ += 1;
    if (fail_at_ >= offset && fail_at_ < offset + static_cast<int64_t>(n)) {
      std::memset(dst, 0, n);
      absl::MutexLock lock(&mu_);
      status_ = absl::FailedPreconditionError("region \"r\" changed while the request was in flight");
      return false;
    }
    std::memcpy(dst, data_.data() + offset, n);
    return true;
  }
  absl::Status status() const override {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  int reads() const { return reads_.load(); }

 private:
  const std::string data_;
  const int64_t fail_at_;
  mutable std::atomic<int> reads_{0};
  mutable absl::Mutex mu_;
  mutable absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

TEST_F(LmHeadUpdatesTest, RowsReadInBlocksOnSeveralThreadsLandExactlyAndAFailedReadFreesThem) {
  // A head of 40 MiB: a put's rows are read in 16 MiB blocks, on as many
  // threads as the machine has (up to 4), 1 MiB per read.
  constexpr int64_t V = 10240, H = 1024;
  LmHeads heads{LmHeads::Options{}};
  LmHeadVersion first = *heads_.Bind("default", "").value();
  first.source.vocab_size = V;
  first.source.hidden_size = H;
  ASSERT_TRUE(heads.Add(first).ok());
  const std::unique_ptr<LmHeadUpdates> updates = Make(nullptr, {}, &heads);
  v1::BeginLmHeadUpdateRequest b = Begin("v1");
  b.set_vocab_size(V);
  b.set_hidden_size(H);
  auto opened = updates->Begin(b);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::string rows(static_cast<size_t>(V * H * 4), '\0');
  for (size_t i = 0; i < rows.size(); i += 4) {
    // Distinct words, finite as floats (bit 30 clear: the exponent is never all ones).
    const uint32_t word = (static_cast<uint32_t>(i / 4) * 2654435761u) & 0xBFFFFFFFu;
    std::memcpy(rows.data() + i, &word, 4);
  }

  // A read failing in the last block: the put fails with the source's
  // error, and its rows are not counted.
  const ReadOnlySource broken(rows, static_cast<int64_t>(rows.size()) - 5);
  auto put = updates->PutRows(opened->update_id(), 0, V, v1::F32, H, broken);
  EXPECT_EQ(put.status().code(), absl::StatusCode::kFailedPrecondition) << put.status();
  EXPECT_NE(put.status().message().find("changed while the request was in flight"), std::string::npos) << put.status();
  auto early = updates->Commit(opened->update_id());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  EXPECT_NE(early.status().message().find("10240 rows missing"), std::string::npos) << early.status();

  // Sent again, every block lands in its place.
  const ReadOnlySource source(rows);
  put = updates->PutRows(opened->update_id(), 0, V, v1::F32, H, source);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(source.reads(), 40) << "40 MiB in 16 MiB blocks, each read (and scanned) 1 MiB at a time";
  ASSERT_TRUE(updates->Commit(opened->update_id()).ok());
  const auto v1 = heads.Find("default", "v1");
  ASSERT_NE(v1, nullptr);
  EXPECT_TRUE(StoredRows(*v1, rows.size()) == rows) << "the committed file holds the rows exactly";
  EXPECT_EQ(v1->sha256.get(), Sha256Hex(rows));
}

// The head's transform through updates: an update may set the scalars and
// a bias (written to the version's own file in the store); the next one
// without them keeps the head's (the bias copied to its own file); a
// released or aborted version's bias file goes with it. Bad values are
// INVALID_ARGUMENT naming the field.
TEST_F(LmHeadUpdatesTest, AnUpdateSetsTheTransformOrKeepsTheHeads) {
  auto releases = std::make_shared<LmHeadReleases>();
  LmHeads::Options ho;
  ho.retain = 1;
  ho.on_release = [releases](const LmHeadVersion& v) { releases->Push(v); };
  LmHeads heads(ho);
  ASSERT_TRUE(heads.Add(*heads_.Bind("default", "").value()).ok());
  const std::unique_ptr<LmHeadUpdates> updates = Make(nullptr, {}, &heads, releases);
  std::vector<float> bias(kV);
  for (int64_t v = 0; v < kV; ++v) bias[v] = 0.5f * static_cast<float>(v) - 3;
  v1::Tensor bias_tensor;
  bias_tensor.set_dtype(v1::F32);
  bias_tensor.add_shape(kV);
  bias_tensor.set_data(bias.data(), bias.size() * 4);
  auto read_bias = [](const LmHeadVersion& v) {
    std::vector<float> out(kV);
    const absl::Status st = ReadLmHeadBias(v.source, 0, kV, out.data());
    EXPECT_TRUE(st.ok()) << st;
    return out;
  };
  auto commit = [&](const v1::BeginLmHeadUpdateRequest& b) {
    auto opened = updates->Begin(b);
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_TRUE(updates->PutRows(opened->update_id(), 0, kV, v1::F32, kH, *MemorySource(Rows(0, kV, 1.0f))).ok());
    const auto committed = updates->Commit(opened->update_id());
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_TRUE(committed->has_bias());
  };

  v1::BeginLmHeadUpdateRequest b1 = Begin("v1");
  b1.set_logit_scale(0.5);
  b1.set_final_logit_softcapping(20);
  *b1.mutable_bias() = bias_tensor;
  commit(b1);
  std::string v1_bias;
  {
    const auto v1 = heads.Find("default", "v1");
    ASSERT_NE(v1, nullptr);
    EXPECT_EQ(v1->source.transform, (LmHeadTransform{true, 0.5, 20.0}));
    v1_bias = v1->source.bias.file;
    EXPECT_TRUE(std::filesystem::exists(v1_bias)) << v1_bias;
    EXPECT_EQ(read_bias(*v1), bias);
    EXPECT_EQ(v1->Load().source().bias_file(), v1_bias);
    EXPECT_EQ(v1->Load().source().final_logit_softcapping(), 20.0);
  }
  commit(Begin("v2"));  // nothing given: v1's transform, the bias in a file of v2's own
  std::string v2_bias;
  {
    const auto v2 = heads.Find("default", "v2");
    ASSERT_NE(v2, nullptr);
    EXPECT_EQ(v2->source.transform, (LmHeadTransform{true, 0.5, 20.0}));
    v2_bias = v2->source.bias.file;
    EXPECT_NE(v2_bias, v1_bias);
    EXPECT_EQ(read_bias(*v2), bias);
    EXPECT_EQ(heads.List()[0].final_logit_softcapping(), 20.0);
  }
  auto bias_files = [&] {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(store_))
      n += e.path().string().find(".bias.safetensors") != std::string::npos;
    return n;
  };
  // v1 was released at v2's commit: the next Begin drops it, and its bias file goes.
  v1::BeginLmHeadUpdateRequest b3 = Begin("v3");
  b3.set_logit_scale(2);
  auto opened = updates->Begin(b3);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_FALSE(std::filesystem::exists(v1_bias)) << v1_bias;
  EXPECT_TRUE(std::filesystem::exists(v2_bias)) << v2_bias;
  EXPECT_EQ(bias_files(), 2u);  // v2's and v3's copy
  ASSERT_TRUE(updates->Abort(opened->update_id()).ok());
  EXPECT_EQ(bias_files(), 1u);  // the aborted update's copy is gone

  // Bad values name their field and open nothing.
  auto refused = [&](const v1::BeginLmHeadUpdateRequest& b, const std::string& field) {
    const auto r = updates->Begin(b);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
  };
  v1::BeginLmHeadUpdateRequest bad = Begin("v4");
  bad.set_logit_scale(0);
  refused(bad, "logit_scale");
  bad = Begin("v4");
  bad.set_final_logit_softcapping(-1);
  refused(bad, "final_logit_softcapping");
  bad = Begin("v4");
  *bad.mutable_bias() = bias_tensor;
  bad.mutable_bias()->set_shape(0, kV - 1);
  refused(bad, "bias");
  bad = Begin("v4");
  *bad.mutable_bias() = bias_tensor;
  std::vector<float> nan = bias;
  nan[3] = std::numeric_limits<float>::quiet_NaN();
  bad.mutable_bias()->set_data(nan.data(), nan.size() * 4);
  refused(bad, "bias[3]");
  bad = Begin("v4");
  *bad.mutable_bias() = bias_tensor;
  bad.mutable_bias()->mutable_shared_memory();
  refused(bad, "bias");
  EXPECT_EQ(heads.Bind("default", "").value()->version, "v2");
  EXPECT_EQ(bias_files(), 1u);
}

TEST(FiniteCheck, FindsTheFirstNonFiniteAcrossBlocksAndUnalignedData) {
  // F16 too, past the first 4096-element block, from an odd address.
  std::vector<uint16_t> f16(10000, 0x3C00);  // 1.0
  EXPECT_FALSE(FirstNonFinite(v1::F16, f16.data(), 10000).has_value());
  f16[9000] = 0x7C00;  // +Inf
  f16[9500] = 0x7E00;  // NaN
  EXPECT_EQ(FirstNonFinite(v1::F16, f16.data(), 10000), std::optional<int64_t>(9000));
  EXPECT_FALSE(FirstNonFinite(v1::F16, f16.data(), 9000).has_value());
  std::string bytes(1 + 5000 * 4, '\0');
  const uint32_t nan = 0x7FC00000u;
  std::memcpy(&bytes[1 + 4097 * 4], &nan, 4);
  EXPECT_EQ(FirstNonFinite(v1::F32, bytes.data() + 1, 5000), std::optional<int64_t>(4097));
  EXPECT_FALSE(FirstNonFinite(v1::I32, bytes.data() + 1, 5000).has_value());
}

TEST_F(LmHeadUpdatesTest, NonFiniteWeightsAreRefusedAtCommitNamingTheFirst) {
  // F32 (the fixture's head) and a BF16 head: NaN, +Inf and -Inf anywhere
  // refuse the commit, naming row and column; the head keeps its version.
  LmHeads bf16_heads{LmHeads::Options{}};
  LmHeadVersion first;
  first.head = "default";
  first.version = "initial";
  first.source.file = store_ + "/start-bf16.safetensors";
  first.source.tensor = "lm_head.weight";
  first.source.dtype = v1::BF16;
  first.source.vocab_size = kV;
  first.source.hidden_size = kH;
  ASSERT_TRUE(bf16_heads.Add(first).ok());
  struct Case {
    DType dtype;
    int64_t row, column;
    uint32_t bits;  // of the bad element, in the dtype's width
    const char* says;
  };
  const Case cases[] = {
      {v1::F32, 5, 2, 0x7FC00000u, "NaN"},
      {v1::F32, 0, 0, 0x7F800000u, "+Inf"},
      {v1::F32, kV - 1, kH - 1, 0xFF800000u, "-Inf"},
      {v1::BF16, 7, 1, 0x7FC1u, "NaN"},
      {v1::BF16, kV - 1, 3, 0x7F80u, "+Inf"},
      {v1::BF16, 0, 0, 0xFF80u, "-Inf"},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(DTypeName(c.dtype)) + " " + c.says);
    LmHeads& heads = c.dtype == v1::BF16 ? bf16_heads : heads_;
    auto updates = Make(nullptr, {}, &heads);
    const std::string before = heads.Bind("default", "").value()->version;
    v1::BeginLmHeadUpdateRequest b = Begin("bad" + std::to_string(n++));
    b.set_dtype(c.dtype);
    auto opened = updates->Begin(b);
    ASSERT_TRUE(opened.ok()) << opened.status();
    const size_t elem = DTypeSize(c.dtype);
    std::string rows(static_cast<size_t>(kV * kH) * elem, '\0');               // zeros: finite
    for (size_t i = 0; i < rows.size(); i += elem) rows[i + elem - 1] = 0x3f;  // ~1.0-ish, finite
    const size_t at = static_cast<size_t>(c.row * kH + c.column) * elem;
    std::memcpy(rows.data() + at, &c.bits, elem);  // little endian: the low bytes
    ASSERT_TRUE(updates->PutRows(opened->update_id(), 0, kV, c.dtype, kH, *MemorySource(rows)).ok());
    const auto committed = updates->Commit(opened->update_id());
    EXPECT_EQ(committed.status().code(), absl::StatusCode::kInvalidArgument) << committed.status();
    EXPECT_NE(committed.status().message().find("row " + std::to_string(c.row) + ", column " +
                                                std::to_string(c.column) + " of the weight is " + c.says),
              std::string::npos)
        << committed.status();
    EXPECT_EQ(heads.Bind("default", "").value()->version, before);
    // The same rows made finite commit.
    std::memset(rows.data() + at, 0, elem);
    v1::BeginLmHeadUpdateRequest good = Begin("good" + std::to_string(n));
    good.set_dtype(c.dtype);
    auto again = updates->Begin(good);
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_TRUE(updates->PutRows(again->update_id(), 0, kV, c.dtype, kH, *MemorySource(rows)).ok());
    EXPECT_TRUE(updates->Commit(again->update_id()).ok());
  }
}

TEST_F(LmHeadUpdatesTest, EachPutScansItsRowsAndTheCommitNamesTheFirstBadElementOfTheWeight) {
  // Puts scan the rows they copy (1 MiB at a time) or, for bytes that
  // followed the message, once they are in; the commit then names the
  // weight's first NaN / Inf whatever the order of the puts, and rows of
  // a failed put do not count.
  constexpr int64_t kBigV = 300, kBigH = 2048;  // 2.4 MB of F32: several scan blocks per put
  LmHeads big{LmHeads::Options{}};
  LmHeadVersion first = *heads_.Bind("default", "").value();  // the fixture's F32 head, resized
  first.source.vocab_size = kBigV;
  first.source.hidden_size = kBigH;
  ASSERT_TRUE(big.Add(first).ok());
  auto updates = Make(nullptr, {}, &big);
  auto begin = [&](const std::string& version) {
    v1::BeginLmHeadUpdateRequest b = Begin(version);
    b.set_vocab_size(kBigV);
    b.set_hidden_size(kBigH);
    auto opened = updates->Begin(b);
    EXPECT_TRUE(opened.ok()) << opened.status();
    return opened.ok() ? opened->update_id() : std::string();
  };
  std::vector<float> weight(static_cast<size_t>(kBigV * kBigH), 0.5f);
  auto rows = [&weight](int64_t b, int64_t n) {
    return std::string(reinterpret_cast<const char*>(weight.data() + b * kBigH),
                       static_cast<size_t>(n * kBigH) * sizeof(float));
  };
  // Bytes that follow the message (a transport's pieces), failing after
  // they were written when `fail`.
  auto follow_put = [&](const std::string& id, int64_t b, int64_t n, const std::string& bytes, bool fail) {
    LmHeadPutIo io;
    io.follow = [&bytes, fail](char* dst, const std::function<void(int64_t)>& progressed) {
      // In pieces of 300001 bytes (not whole elements), each reported.
      for (size_t at = 0; at < bytes.size(); at += 300001) {
        const size_t n = std::min<size_t>(300001, bytes.size() - at);
        std::memcpy(dst + at, bytes.data() + at, n);
        progressed(static_cast<int64_t>(at + n));
      }
      return fail ? absl::UnavailableError("the stream broke") : absl::OkStatus();
    };
    v1::LmHeadRows put;
    put.set_update_id(id);
    put.set_row_begin(b);
    v1::Tensor* t = put.mutable_rows();
    t->set_dtype(v1::F32);
    t->add_shape(n);
    t->add_shape(kBigH);
    return updates->Put(put, io);
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // Row 250 is 1.2 MB into the put of rows [100, 300): its second scan block.
  weight[250 * kBigH + 7] = nan;
  weight[260 * kBigH] = inf;
  weight[3 * kBigH + 5] = -inf;
  {
    // The later rows come first: the commit still names row 3.
    const std::string id = begin("two-bad");
    ASSERT_TRUE(updates->PutRows(id, 100, 200, v1::F32, kBigH, *MemorySource(rows(100, 200))).ok());
    ASSERT_TRUE(follow_put(id, 0, 100, rows(0, 100), false).ok());
    const auto committed = updates->Commit(id);
    EXPECT_EQ(committed.status().code(), absl::StatusCode::kInvalidArgument) << committed.status();
    EXPECT_NE(committed.status().message().find("row 3, column 5 of the weight is -Inf"), std::string::npos)
        << committed.status();
  }
  weight[3 * kBigH + 5] = 0.5f;
  {
    const std::string id = begin("one-bad");
    ASSERT_TRUE(updates->PutRows(id, 0, 100, v1::F32, kBigH, *MemorySource(rows(0, 100))).ok());
    ASSERT_TRUE(follow_put(id, 100, 200, rows(100, 200), false).ok());  // found in its fifth piece
    const auto committed = updates->Commit(id);
    EXPECT_EQ(committed.status().code(), absl::StatusCode::kInvalidArgument) << committed.status();
    EXPECT_NE(committed.status().message().find("row 250, column 7 of the weight is NaN"), std::string::npos)
        << committed.status();
  }
  {
    // A put that failed with bad rows in it counts nothing: sent again
    // finite, the update commits.
    const std::string bad_rows = rows(100, 200);
    weight[250 * kBigH + 7] = 0.5f;
    weight[260 * kBigH] = 0.5f;
    const std::string id = begin("retried");
    EXPECT_EQ(follow_put(id, 100, 200, bad_rows, true).status().code(), absl::StatusCode::kUnavailable);
    ASSERT_TRUE(follow_put(id, 100, 200, rows(100, 200), false).ok());
    ASSERT_TRUE(updates->PutRows(id, 0, 100, v1::F32, kBigH, *MemorySource(rows(0, 100))).ok());
    const auto committed = updates->Commit(id);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->version(), "retried");
  }
}

TEST_F(LmHeadUpdatesTest, RowsAWorkerStagedAreScannedBeforeThePutAnswers) {
  // CUDA IPC rows are written by a worker, not copied here: the put scans
  // them once staged, and the commit names their bad element.
  FakeGpuWorker gpu;
  const std::string handle(64, 'h');
  std::string ipc_rows = Rows(20, kV - 20, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(ipc_rows.data() + ((30 - 20) * kH + 2) * sizeof(float), &inf, sizeof(float));  // row 30, column 2
  gpu.allocations[handle] = ipc_rows;
  auto updates = Make([&gpu](const internal::v1::LmHeadStage& s) { return gpu.Stage(s); });
  auto opened = updates->Begin(Begin("staged-bad"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_TRUE(updates->PutRows(opened->update_id(), 0, 20, v1::F32, kH, *MemorySource(Rows(0, 20, 1.0f))).ok());
  ASSERT_TRUE(updates->PutRows(opened->update_id(), 20, kV - 20, v1::F32, kH, *IpcRows(handle, 0, kV - 20)).ok());
  const auto committed = updates->Commit(opened->update_id());
  EXPECT_EQ(committed.status().code(), absl::StatusCode::kInvalidArgument) << committed.status();
  EXPECT_NE(committed.status().message().find("row 30, column 2 of the weight is +Inf"), std::string::npos)
      << committed.status();
  EXPECT_EQ(heads_.Bind("default", "").value()->version, "initial");
}

namespace {

/// A [kV, kH] F32 head "lm_head.weight" with every element `value`.
void WriteHead(const std::string& path, float value) {
  v1::Tensor t;
  t.set_name("lm_head.weight");
  t.set_dtype(v1::F32);
  t.add_shape(kV);
  t.add_shape(kH);
  const std::vector<float> v(static_cast<size_t>(kV * kH), value);
  t.set_data(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  ASSERT_TRUE(WriteSafetensors(path, {t}).ok()) << path;
}

void WriteText(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

/// Threads of this process (/proc/self/task).
size_t Threads() {
  return static_cast<size_t>(std::distance(std::filesystem::directory_iterator("/proc/self/task"), {}));
}

}  // namespace

/// File sources are confined to --lm-head-update-dir (issue 32 findings
/// 1-3): opened once, beneath it, no symlink followed, regular files only,
/// read through that descriptor.
class ConfinedFileSourceTest : public LmHeadUpdatesTest {
 protected:
  void SetUp() override {
    LmHeadUpdatesTest::SetUp();
    update_dir_ = store_ + "-updates";
    outside_ = store_ + "-outside";
    std::filesystem::create_directories(update_dir_ + "/race");
    std::filesystem::create_directories(outside_);
    WriteHead(update_dir_ + "/race/x.safetensors", 1.0f);
    WriteHead(outside_ + "/x.safetensors", 7.0f);
  }
  void TearDown() override {
    std::filesystem::remove_all(update_dir_);
    std::filesystem::remove_all(outside_);
    LmHeadUpdatesTest::TearDown();
  }
  /// PutFile of `path` into a new update of version `version`; the update is aborted unless `keep`.
  absl::Status Put(LmHeadUpdates& updates, const std::string& version, const std::string& path,
                   std::string* id = nullptr) {
    auto opened = updates.Begin(Begin(version));
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return opened.status();
    v1::LmHeadRows put;
    put.set_update_id(opened->update_id());
    put.mutable_file()->set_path(path);
    const absl::Status st = updates.Put(put).status();
    if (id != nullptr && st.ok()) {
      *id = opened->update_id();
    } else {
      (void)updates.Abort(opened->update_id());
    }
    return st;
  }
  std::string outside_;
};

/// LmHeadRows of update `id`: rows [row_begin, row_begin + n) as a [n, kH]
/// F32 tensor holding `data` inline (its source then is data).
v1::LmHeadRows RowsPut(const std::string& id, int64_t row_begin, int64_t n, const std::string& data) {
  v1::LmHeadRows put;
  put.set_update_id(id);
  put.set_row_begin(row_begin);
  v1::Tensor* t = put.mutable_rows();
  t->set_dtype(v1::F32);
  t->add_shape(n);
  t->add_shape(kH);
  t->set_data(data);
  return put;
}

// The transport-free core, driven as any non-gRPC caller would: one Put
// entry point for every row source (inline bytes, bytes that follow,
// a memory reference, a checkpoint file), then Commit; the committed
// bytes and digest are the rows sent.
TEST_F(ConfinedFileSourceTest, BeginPutCommitThroughTheCoreWithEverySource) {
  auto updates = Make();
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->update_id();
  const std::string all = Rows(0, kV, 3.0f);
  auto part = [&all](int64_t b, int64_t n) { return all.substr(static_cast<size_t>(b * kH * 4), n * kH * 4); };

  // Inline bytes.
  auto put = updates->Put(RowsPut(id, 0, 10, part(0, 10)));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->rows_received(), 10);
  // Two inline rows, the rest following (a transport's pieces).
  LmHeadPutIo io;
  int progressed = 0;
  io.follow = [&](char* dst, const std::function<void(int64_t)>& progress) {
    std::memcpy(dst, part(10, 10).data(), part(10, 10).size());
    progress(static_cast<int64_t>(part(10, 10).size()));
    ++progressed;
    return absl::OkStatus();
  };
  put = updates->Put(RowsPut(id, 10, 10, part(10, 2)), io);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(progressed, 1);
  EXPECT_EQ(put->rows_received(), 20);
  // A memory reference, resolved by the app's resolver (here: the caller's
  // session has no such region), which names the field.
  v1::LmHeadRows referenced = RowsPut(id, 20, kV - 20, "");
  referenced.mutable_rows()->mutable_shared_memory()->set_region("r");
  LmHeadPutIo caller;
  caller.caller.session = []() -> absl::StatusOr<std::string> { return std::string("session-1"); };
  const absl::Status unresolved = updates->Put(referenced, caller).status();
  EXPECT_EQ(unresolved.code(), absl::StatusCode::kNotFound) << unresolved;
  EXPECT_TRUE(absl::StartsWith(unresolved.message(), "rows: ")) << unresolved;
  put = updates->Put(RowsPut(id, 20, kV - 20, part(20, kV - 20)));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->rows_received(), kV);

  // The protocol's checks hold for every caller.
  EXPECT_EQ(updates->Put(v1::LmHeadRows()).status().code(), absl::StatusCode::kInvalidArgument);  // no source
  v1::LmHeadRows bad_shape = RowsPut(id, 0, 1, part(0, 1));
  bad_shape.mutable_rows()->add_shape(1);
  EXPECT_EQ(updates->Put(bad_shape).status().code(), absl::StatusCode::kInvalidArgument);
  v1::LmHeadRows short_inline = RowsPut(id, 0, 2, part(0, 1));  // no follow: the inline bytes are all there are
  EXPECT_EQ(updates->Put(short_inline).status().code(), absl::StatusCode::kInvalidArgument);
  v1::LmHeadRows file;
  file.set_update_id(id);
  file.set_row_begin(3);
  file.mutable_file()->set_path("race/x.safetensors");
  EXPECT_EQ(updates->Put(file).status().code(), absl::StatusCode::kInvalidArgument);  // a file gives every row

  auto committed = updates->Commit(id);
  ASSERT_TRUE(committed.ok()) << committed.status();
  const auto v1_version = heads_.Find("default", "v1");
  ASSERT_NE(v1_version, nullptr);
  EXPECT_EQ(StoredRows(*v1_version, all.size()), all);
  EXPECT_EQ(v1_version->sha256.get(), Sha256Hex(all));

  // A checkpoint file under the update folder, through the same entry point.
  opened = updates->Begin(Begin("v2"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  file.set_update_id(opened->update_id());
  file.set_row_begin(0);
  put = updates->Put(file);
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_TRUE(updates->Commit(opened->update_id()).ok());
  const std::vector<float> ones(static_cast<size_t>(kV * kH), 1.0f);
  EXPECT_EQ(StoredRows(*heads_.Find("default", "v2"), ones.size() * 4),
            std::string(reinterpret_cast<const char*>(ones.data()), ones.size() * 4));
}

// Issue 32 finding 5: a put whose sender stopped sending (its stream open,
// no bytes) no longer keeps the update open past the time-out: the put's
// call is ended, the put answers ABORTED naming the time-out, the update
// ends with outcome "timeout" and the head takes a new update.
TEST_F(LmHeadUpdatesTest, AStalledPutIsTimedOutAndFreesTheHead) {
  timeout_ = std::chrono::milliseconds(2000);
  absl::Notification timed_out, cancelled;
  LmHeadUpdateObservers observers;
  observers.on_end = [&timed_out](const std::string&, const std::string& outcome, double, int64_t) {
    if (outcome == "timeout") timed_out.Notify();
  };
  auto updates = Make(nullptr, observers);
  auto opened = updates->Begin(Begin("v1"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  LmHeadPutIo io;
  io.follow = [&cancelled](char*, const std::function<void(int64_t)>& progressed) {
    progressed(0);  // the first piece, then nothing
    cancelled.WaitForNotificationWithTimeout(absl::Seconds(120));
    return absl::CancelledError("the call ended");
  };
  io.cancel = [&cancelled] { cancelled.Notify(); };
  auto stalled =
      std::async(std::launch::async, [&] { return updates->Put(RowsPut(opened->update_id(), 0, kV, ""), io); });
  ASSERT_TRUE(timed_out.WaitForNotificationWithTimeout(absl::Seconds(60))) << "the stalled update never timed out";
  EXPECT_TRUE(cancelled.HasBeenNotified()) << "the stalled put's call was not ended";
  const absl::StatusOr<v1::LmHeadUpdate> put = stalled.get();
  EXPECT_EQ(put.status().code(), absl::StatusCode::kAborted) << put.status();
  EXPECT_NE(put.status().message().find("--lm-head-update-timeout"), std::string::npos) << put.status();
  // The head is free again; a Commit of the old update answers how it ended.
  EXPECT_TRUE(updates->Begin(Begin("v2")).ok());
  const auto commit = updates->Commit(opened->update_id());
  EXPECT_EQ(commit.status().code(), absl::StatusCode::kAborted) << commit.status();
}

// A retried put gets the first one's answer: the same range with the same
// bytes is OK and counts once (compared with the staged bytes, whatever
// the source); other bytes or an overlap are INVALID_ARGUMENT; a put that
// failed part way counted nothing and may be sent again.
TEST_F(LmHeadUpdatesTest, APutRetriedWithTheSameBytesAnswersOkAndCountsOnce) {
  auto updates = Make();
  v1::BeginLmHeadUpdateRequest b = Begin("v1");
  const std::string all = Rows(0, kV, 5.0f);
  b.set_sha256(Sha256Hex(all));
  auto opened = updates->Begin(b);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const std::string id = opened->update_id();
  const std::string head = all.substr(0, 10 * kH * 4);
  ASSERT_TRUE(updates->Put(RowsPut(id, 0, 10, head)).ok());
  auto again = updates->Put(RowsPut(id, 0, 10, head));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->rows_received(), 10);
  // The same bytes following the message (a retried stream of pieces).
  LmHeadPutIo io;
  io.follow = [&head](char* dst, const std::function<void(int64_t)>&) {
    std::memcpy(dst, head.data(), head.size());
    return absl::OkStatus();
  };
  again = updates->Put(RowsPut(id, 0, 10, ""), io);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->rows_received(), 10);
  std::string other = head;
  other[5] ^= 1;
  EXPECT_EQ(updates->Put(RowsPut(id, 0, 10, other)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(updates->Put(RowsPut(id, 5, 10, all.substr(5 * kH * 4, 10 * kH * 4))).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A put that failed part way (its transport broke) counted nothing.
  LmHeadPutIo broken;
  broken.follow = [&all](char* dst, const std::function<void(int64_t)>&) {
    std::memcpy(dst, all.data() + 10 * kH * 4, kH * 4);
    return absl::UnavailableError("the stream broke");
  };
  EXPECT_EQ(updates->Put(RowsPut(id, 10, kV - 10, ""), broken).status().code(), absl::StatusCode::kUnavailable);
  auto rest = updates->Put(RowsPut(id, 10, kV - 10, all.substr(10 * kH * 4)));
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(rest->rows_received(), kV);
  const auto committed = updates->Commit(id);  // the announced sha256 holds: every row once, as sent
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(StoredRows(*heads_.Find("default", "v1"), all.size()), all);
}

// An update's id is its capability: logs name it by its tag only.
TEST_F(LmHeadUpdatesTest, LogsOfAnUpdateNameItsTagNeverItsId) {
  const std::string log_path = store_ + ".log";
  const int saved = dup(2);
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(saved, 0);
  ASSERT_GE(log_fd, 0);
  ASSERT_EQ(dup2(log_fd, 2), 2);  // LogLine writes to fd 2
  std::string committed_id, aborted_id;
  {
    auto updates = Make();
    auto opened = updates->Begin(Begin("v1"));
    if (opened.ok()) {
      committed_id = opened->update_id();
      (void)updates->Commit(committed_id);  // rows missing: refused
      (void)updates->Put(RowsPut(committed_id, 0, kV, Rows(0, kV, 1.0f)));
      (void)updates->Commit(committed_id);
    }
    opened = updates->Begin(Begin("v2"));
    if (opened.ok()) {
      aborted_id = opened->update_id();
      (void)updates->Abort(aborted_id);
    }
  }
  dup2(saved, 2);
  close(saved);
  close(log_fd);
  ASSERT_FALSE(committed_id.empty());
  ASSERT_FALSE(aborted_id.empty());
  const std::string log = ReadAll(log_path);
  std::filesystem::remove(log_path);
  EXPECT_NE(log.find(UpdateTag(committed_id)), std::string::npos) << log;  // the log did capture the update
  EXPECT_NE(log.find(UpdateTag(aborted_id)), std::string::npos) << log;
  EXPECT_EQ(log.find(committed_id), std::string::npos) << log;
  EXPECT_EQ(log.find(aborted_id), std::string::npos) << log;
  EXPECT_EQ(UpdateTag(committed_id), Sha256Hex(committed_id).substr(0, 8));
}

TEST_F(ConfinedFileSourceTest, ASymlinkSwappedInDuringThePutNeverCommitsTheOutsideFile) {
  auto updates = Make();
  // D/racelink -> the outside folder; a thread swaps D/race and D/racelink
  // (renameat2 RENAME_EXCHANGE) as fast as it can.
  ASSERT_EQ(symlink(outside_.c_str(), (update_dir_ + "/racelink").c_str()), 0);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> swaps{0};
  std::thread swapper([&] {
    const std::string a = update_dir_ + "/race", b = update_dir_ + "/racelink";
    while (!stop.load()) {
      if (syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) ++swaps;
    }
  });
  std::vector<float> ones(static_cast<size_t>(kV * kH), 1.0f), sevens(ones.size(), 7.0f);
  const std::string want(reinterpret_cast<const char*>(ones.data()), ones.size() * 4),
      outside(reinterpret_cast<const char*>(sevens.data()), sevens.size() * 4);
  int committed = 0, refused = 0, outside_commits = 0;
  for (int i = 0; i < 300; ++i) {
    std::string id;
    const absl::Status st = Put(*updates, "r" + std::to_string(i), "race/x.safetensors", &id);
    if (!st.ok()) {
      ++refused;
      EXPECT_TRUE(st.code() == absl::StatusCode::kPermissionDenied || st.code() == absl::StatusCode::kNotFound) << st;
      EXPECT_EQ(st.message().find(outside_), std::string::npos) << st;
      continue;
    }
    ASSERT_TRUE(updates->Commit(id).ok());
    ++committed;
    const auto v = heads_.Find("default", "r" + std::to_string(i));
    ASSERT_NE(v, nullptr);
    const std::string rows = StoredRows(*v, want.size());
    if (rows == outside) ++outside_commits;
    EXPECT_EQ(rows, want) << "try " << i;
  }
  stop = true;
  swapper.join();
  EXPECT_EQ(outside_commits, 0);
  EXPECT_GT(swaps.load(), 0);
  EXPECT_EQ(committed + refused, 300);
}

TEST_F(ConfinedFileSourceTest, AFilePutReadsAtMost16MiBOfHeaderOrIndexIntoMemory) {
  auto updates = Make();
  // A header length just over the bound, the file long enough to hold it.
  const uint64_t n = kMaxUpdateFileMetadataBytes + 1;
  std::string bytes(8 + n, ' ');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  WriteText(update_dir_ + "/big-header.safetensors", bytes);
  absl::Status st = Put(*updates, "big-header", "big-header.safetensors");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("header length exceeds 16777216"), absl::string_view::npos) << st;
  // An index over the bound.
  std::filesystem::create_directories(update_dir_ + "/big-index");
  WriteText(update_dir_ + "/big-index/model.safetensors.index.json",
            "{\"weight_map\": {}, \"pad\": \"" + std::string(kMaxUpdateFileMetadataBytes, 'x') + "\"}");
  st = Put(*updates, "big-index", "big-index");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // A good file still goes in.
  std::string id;
  ASSERT_TRUE(Put(*updates, "good", "race/x.safetensors", &id).ok());
  EXPECT_TRUE(updates->Commit(id).ok());
}

TEST_F(ConfinedFileSourceTest, AnIndexNamingAFileOutsideReadsNoByteOfItAndTellsNothingOfIt) {
  auto updates = Make();
  // An outside "secret" whose first 8 bytes, read as a header length, would be a large number.
  WriteText(outside_ + "/secret", "root:*:2SECRETSECRET");
  const std::string number = "3619251681095544690";
  std::filesystem::create_directories(update_dir_ + "/idx");
  std::map<std::string, std::string> messages;
  for (const std::string& shard : {outside_ + "/secret", outside_ + "/absent", std::string("/etc/shadow"),
                                   "../../" + std::filesystem::path(outside_).filename().string() + "/secret",
                                   "../../" + std::filesystem::path(outside_).filename().string() + "/absent"}) {
    SCOPED_TRACE(shard);
    WriteText(update_dir_ + "/idx/model.safetensors.index.json",
              "{\"weight_map\": {\"lm_head.weight\": \"" + shard + "\"}}");
    const absl::Status st = Put(*updates, "idx", "idx");
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
    const std::string msg(st.message());
    EXPECT_EQ(msg.find(number), std::string::npos) << msg;
    EXPECT_EQ(msg.find("root:"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("SECRET"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("header length"), std::string::npos) << msg;
    // The same words whether the outside file exists or not.
    std::string shape = msg;
    for (const std::string& name : {std::string("secret"), std::string("absent")})
      for (size_t at; (at = shape.find(name)) != std::string::npos;) shape.replace(at, name.size(), "NAME");
    messages[shard.substr(0, 3)] = messages.count(shard.substr(0, 3)) ? messages[shard.substr(0, 3)] : shape;
    EXPECT_EQ(messages[shard.substr(0, 3)], shape);
  }
  // A file inside that is not a safetensors file: its bytes are not echoed either.
  WriteText(update_dir_ + "/junk.safetensors", "root:*:2SECRETSECRET");
  const absl::Status st = Put(*updates, "junk", "junk.safetensors");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("junk.safetensors"), std::string::npos) << st;
  EXPECT_NE(st.message().find("not a safetensors file"), std::string::npos) << st;
  EXPECT_EQ(st.message().find(number), std::string::npos) << st;
  EXPECT_EQ(st.message().find(update_dir_), std::string::npos) << st;
}

TEST_F(ConfinedFileSourceTest, AFifoFailsAtOnceAndLeavesNoThreadBehind) {
  auto updates = Make();
  ASSERT_EQ(mkfifo((update_dir_ + "/f.safetensors").c_str(), 0600), 0);
  const size_t threads = Threads();
  for (int i = 0; i < 5; ++i) {
    // Run where a blocked open can be released (by opening the FIFO for
    // writing) so that a failure is a failure, not a hung test.
    auto put = std::async(std::launch::async, [&] { return Put(*updates, "fifo", "f.safetensors"); });
    if (put.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      ADD_FAILURE() << "PutFile of a FIFO blocked";
      const int w = open((update_dir_ + "/f.safetensors").c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
      if (w >= 0) close(w);
    }
    const absl::Status st = put.get();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("\"f.safetensors\": not a regular file"), std::string::npos) << st;
  }
  EXPECT_EQ(Threads(), threads);
}

TEST_F(ConfinedFileSourceTest, SymlinksAtAnyComponentAndDotDotAreRefused) {
  auto updates = Make();
  // Symlinks refused even when they stay inside: a link is never followed.
  ASSERT_EQ(symlink("race", (update_dir_ + "/dirlink").c_str()), 0);
  ASSERT_EQ(symlink("x.safetensors", (update_dir_ + "/race/filelink.safetensors").c_str()), 0);
  ASSERT_EQ(symlink(outside_.c_str(), (update_dir_ + "/out").c_str()), 0);
  for (const std::string& path :
       std::vector<std::string>{"dirlink/x.safetensors", "race/filelink.safetensors", "out/x.safetensors", "out",
                                "race/../race/x.safetensors", "../x.safetensors", "race/./../../x.safetensors",
                                std::string(outside_ + "/x.safetensors")}) {
    SCOPED_TRACE(path);
    const absl::Status st = Put(*updates, "link", path);
    EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
    EXPECT_NE(st.message().find("file.path \"" + path + "\""), std::string::npos) << st;
  }
  EXPECT_EQ(Put(*updates, "absent", "race/absent.safetensors").code(), absl::StatusCode::kNotFound);
  // The real file, by its plain name and with "." components, is fine.
  for (const std::string path : {"race/x.safetensors", "./race//x.safetensors", "race"}) {
    if (path == "race") WriteHead(update_dir_ + "/race/model.safetensors", 1.0f);
    EXPECT_TRUE(Put(*updates, "ok", path).ok()) << path;
  }
}

TEST(ConfinedFile, OpenBeneathAndItsComponentWalkGiveTheSameAnswers) {
  const std::string dir = ::testing::TempDir() + "/confined_file_test." + std::to_string(getpid());
  std::filesystem::create_directories(dir + "/a/b");
  WriteText(dir + "/a/f", "x");
  ASSERT_EQ(symlink("a", (dir + "/l").c_str()), 0);
  ASSERT_EQ(symlink("f", (dir + "/a/lf").c_str()), 0);
  ASSERT_EQ(mkfifo((dir + "/a/p").c_str(), 0600), 0);
  const UniqueFd root(open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(root.valid());
  for (bool walk : {false, true}) {
    SCOPED_TRACE(walk ? "walk" : "openat2");
    auto open = [&](const std::string& p, bool dir_ok = false) {
      return OpenBeneathWith(root.get(), p, "file.path", dir_ok, walk);
    };
    auto f = open("a/f");
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->size, 1u);
    EXPECT_FALSE(f->is_dir);
    EXPECT_TRUE(open("./a//f").ok());
    for (const char* p : {"l/f", "a/lf", "l", "a/../a/f", "/etc/passwd", ""})
      EXPECT_EQ(open(p).status().code(), absl::StatusCode::kPermissionDenied) << p;
    EXPECT_EQ(open("a/none").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(open("a/f/x").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(open("a/p").status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(open("a/b").status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(open("a/b", /*dir_ok=*/true).ok());
    EXPECT_EQ(open(std::string("a\0f", 3)).status().code(), absl::StatusCode::kInvalidArgument);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace logprob
