// libFuzzer target: lm_head updates (server/heads/lm_head_updates.h): Begin with
// fuzzed shapes, dtypes, versions and sha256s, then a fuzzed sequence of
// puts (PutRows, or Put of an LmHeadRows message; row ranges anywhere, overlapping, repeated, of the wrong size,
// dtype or width, from sources that fail midway, from sources the
// front-end cannot read that a fake worker stages or fails to), Commit and
// Abort, on a [37, 4] F32 head over 2 fake workers.
//
// Invariants: every call answers a documented status; a Commit succeeds
// only when every row came exactly once through successful puts (a put
// repeating a range received whole with its bytes answers OK, counted once), and then
// the committed version's store file holds exactly the bytes of those
// puts, all finite (NaN / Inf are refused at commit), its sha256 is theirs, and the workers were asked to load that
// version; the current version is then the committed one, and an aborted
// or failed update never changes it. A violated invariant traps.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/finite_check.h"
#include "common/sha256.h"
#include "google/protobuf/stubs/logging.h"
#include "server/heads/lm_head_updates.h"
#include "server/heads/lm_heads.h"
#include "server/inputs/input_source.h"

namespace {

using logprob::LmHeads;
using logprob::LmHeadUpdates;
namespace v1 = logprob::v1;

#define CHECK(cond)                                                                                     \
  do {                                                                                                  \
    if (!(cond)) {                                                                                      \
      std::fprintf(stderr, "fuzz_lm_head_update: invariant violated: %s (line %d)\n", #cond, __LINE__); \
      __builtin_trap();                                                                                 \
    }                                                                                                   \
  } while (0)

constexpr int64_t kV = 37, kH = 4, kRowBytes = kH * 4;
std::string* store_dir = nullptr;

/// A source that fails after `good` bytes (a client region truncated midway).
class FailingSource final : public logprob::InputSource {
 public:
  FailingSource(int64_t size, int64_t good) : InputSource(logprob::InputKind::kSharedMemory, size), good_(good) {}
  // Reads 0x5a bytes up to `good`, fails beyond.
  bool Read(int64_t offset, size_t n, char* dst) const override {
    std::fill(dst, dst + n, '\x5a');
    if (offset + static_cast<int64_t>(n) <= good_) return true;
    return false;
  }
  absl::Status status() const override { return absl::DataLossError("the region shrank"); }

 private:
  const int64_t good_;
};

/// Rows the front-end cannot read (as a client's CUDA IPC allocation): it
/// refers a worker to them (the fuzzer's stage callback writes them).
class ReferredSource final : public logprob::InputSource {
 public:
  explicit ReferredSource(int64_t size) : InputSource(logprob::InputKind::kCudaIpc, size) {}
  bool Read(int64_t, size_t n, char* dst) const override {
    std::fill(dst, dst + n, '\0');
    return false;
  }
  bool Refer(int64_t offset, int64_t n, logprob::internal::v1::WorkItem* item) const override {
    logprob::internal::v1::CudaIpcPayload* p = item->mutable_cuda_ipc();
    p->set_handle(std::string(64, 'h'));
    p->set_offset(offset);
    p->set_byte_size(n);
    return true;
  }
};

/// The bytes the fake worker stages for a ReferredSource.
constexpr char kStagedByte = '\x3c';

bool Is(const absl::Status& st, std::initializer_list<absl::StatusCode> codes) {
  for (absl::StatusCode c : codes)
    if (st.code() == c) return !st.message().empty();
  return false;
}

std::string ReadFile(const std::string& path, uint64_t offset, size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::string out(n, '\0');
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(out.data(), static_cast<std::streamsize>(n));
  return in.gcount() == static_cast<std::streamsize>(n) ? out : std::string();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  // The store in memory when the machine has /dev/shm (as the server's
  // default store): no file system journal per input.
  char shm_dir[] = "/dev/shm/fuzz_lm_head_update.XXXXXX";
  char tmp_dir[] = "/tmp/fuzz_lm_head_update.XXXXXX";
  const char* dir = mkdtemp(shm_dir);
  if (dir == nullptr) dir = mkdtemp(tmp_dir);
  CHECK(dir != nullptr);
  store_dir = new std::string(dir);
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(*store_dir, ec);
  });
  return 0;
}

/// One input's run (Run); then the store is emptied (committed versions'
/// files stay until released, and nothing releases them here).
void Run(FuzzedDataProvider& p);

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider p(data, size);
  Run(p);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(*store_dir, ec)) std::filesystem::remove_all(e.path(), ec);
  return 0;
}

void Run(FuzzedDataProvider& p) {
  LmHeads heads(LmHeads::Options{});
  logprob::LmHeadVersion first;
  first.head = "default";
  first.version = "initial";
  first.source.file = *store_dir + "/start-not-read.safetensors";
  first.source.tensor = "lm_head.weight";
  first.source.dtype = v1::F32;
  first.source.vocab_size = kV;
  first.source.hidden_size = kH;
  first.sha256 = logprob::KnownSha256(std::string(64, '0'));
  first.bytes_per_worker = (kV + 1) / 2 * kRowBytes;
  CHECK(heads.Add(first).ok());
  std::vector<std::string> loaded;  // versions the workers were asked to load
  logprob::LmHeadWorkers workers;
  workers.load = [&loaded, &p](const logprob::internal::v1::LmHeadLoad& load) -> absl::StatusOr<int64_t> {
    loaded.push_back(load.head().version());
    if (p.ConsumeIntegralInRange(0, 15) == 0) return absl::UnavailableError("a worker died while loading");
    return 0;
  };
  workers.serving = [](int64_t) { return true; };
  workers.drop = [](const logprob::internal::v1::LmHeadRef&) { return true; };
  // A worker that stages referred rows (CUDA workers on this host), or none.
  bool stage_failed = false;
  if (p.ConsumeIntegralInRange(0, 3) != 0)
    workers.stage = [&p, &stage_failed](const logprob::internal::v1::LmHeadStage& stage) -> absl::Status {
      stage_failed = p.ConsumeIntegralInRange(0, 7) == 0;
      if (stage_failed) return absl::InternalError("the worker's device copy failed");
      const int fd = open(stage.file().c_str(), O_WRONLY | O_CLOEXEC);
      CHECK(fd >= 0);
      struct stat st {};
      CHECK(fstat(fd, &st) == 0);
      CHECK(stage.file_offset() >= 0 && stage.source().byte_size() > 0 &&
            stage.file_offset() + stage.source().byte_size() <= st.st_size);
      const std::string bytes(static_cast<size_t>(stage.source().byte_size()), kStagedByte);
      CHECK(pwrite(fd, bytes.data(), bytes.size(), stage.file_offset()) == static_cast<ssize_t>(bytes.size()));
      close(fd);
      return absl::OkStatus();
    };
  LmHeadUpdates::Options options;
  options.allowed = true;
  options.store_dir = *store_dir;
  LmHeadUpdates updates(options, &heads, std::make_shared<logprob::LmHeadReleases>(), workers);

  v1::BeginLmHeadUpdateRequest begin;
  begin.set_head(p.ConsumeIntegralInRange(0, 7) == 0 ? p.ConsumeRandomLengthString(8) : "default");
  begin.set_version(p.ConsumeBool() ? "v1" : p.ConsumeRandomLengthString(16));
  begin.set_vocab_size(p.ConsumeIntegralInRange(0, 15) == 0 ? p.ConsumeIntegral<int64_t>() : kV);
  begin.set_hidden_size(p.ConsumeIntegralInRange(0, 15) == 0 ? p.ConsumeIntegral<int64_t>() : kH);
  begin.set_dtype(p.ConsumeIntegralInRange(0, 15) == 0 ? static_cast<v1::DType>(p.ConsumeIntegralInRange(0, 6))
                                                       : v1::F32);
  if (p.ConsumeIntegralInRange(0, 3) == 0) begin.set_sha256(p.ConsumeRandomLengthString(70));
  const absl::StatusOr<v1::LmHeadUpdate> opened = updates.Begin(begin);
  if (!opened.ok()) {
    CHECK(Is(opened.status(),
             {absl::StatusCode::kNotFound, absl::StatusCode::kInvalidArgument, absl::StatusCode::kAlreadyExists}));
    CHECK(heads.Bind("default", "").value()->version == "initial");
    return;
  }
  CHECK(begin.head() == "default" && begin.vocab_size() == kV && begin.hidden_size() == kH && begin.dtype() == v1::F32);
  const std::string id = opened->update_id();

  // The bytes of every row put successfully, and how often.
  std::vector<std::string> rows(kV);
  std::vector<int> given(kV, 0);
  std::vector<std::string> keep;                            // put sources' bytes outlive the calls
  std::map<std::pair<int64_t, int64_t>, std::string> puts;  // (row_begin, n) of successful puts: their bytes
  const int ops = p.ConsumeIntegralInRange(0, 12);
  bool ended = false;
  for (int op = 0; op < ops && !ended; ++op) {
    const int what = p.ConsumeIntegralInRange(0, 9);
    const std::string target = p.ConsumeIntegralInRange(0, 15) == 0 ? p.ConsumeRandomLengthString(24) : id;
    if (what <= 6) {
      const int64_t row_begin =
          p.ConsumeBool() ? p.ConsumeIntegralInRange<int64_t>(-2, kV + 2) : p.ConsumeIntegral<int64_t>();
      const int64_t n = p.ConsumeBool() ? p.ConsumeIntegralInRange<int64_t>(-1, kV + 1) : p.ConsumeIntegral<int64_t>();
      const v1::DType dtype = p.ConsumeIntegralInRange(0, 15) == 0 ? v1::BF16 : v1::F32;
      const int64_t columns = p.ConsumeIntegralInRange(0, 15) == 0 ? kH + 1 : kH;
      int64_t bytes = (n > 0 && n <= kV) ? n * kRowBytes : 0;
      if (p.ConsumeIntegralInRange(0, 15) == 0) bytes += p.ConsumeIntegralInRange<int64_t>(-3, 3);
      if (bytes < 0) bytes = 0;
      std::shared_ptr<const logprob::InputSource> source;
      std::string content;  // the bytes a successful put must have written
      bool readable = true;
      const int source_kind = p.ConsumeIntegralInRange(0, 15);
      stage_failed = false;
      if (source_kind == 1) {
        source = std::make_shared<ReferredSource>(bytes);
        content.assign(static_cast<size_t>(bytes), kStagedByte);
      } else if (source_kind == 0) {
        const int64_t good = p.ConsumeIntegralInRange<int64_t>(0, bytes);
        source = std::make_shared<FailingSource>(bytes, good);
        readable = good == bytes;
        content.assign(static_cast<size_t>(bytes), '\x5a');
      } else {
        content = p.ConsumeBytesAsString(static_cast<size_t>(bytes));
        content.resize(static_cast<size_t>(bytes), '\x11');
        keep.push_back(content);
        source = logprob::MemorySource(keep.back());
      }
      // Inline rows also go through the one entry point a transport uses
      // (LmHeadUpdates::Put of an LmHeadRows message).
      const bool as_message = source_kind >= 2 && p.ConsumeBool();
      v1::LmHeadRows message;
      if (as_message) {
        message.set_update_id(target);
        message.set_row_begin(row_begin);
        v1::Tensor* t = message.mutable_rows();
        t->set_dtype(dtype);
        t->add_shape(n);
        t->add_shape(columns);
        t->set_data(content);
      }
      const absl::StatusOr<v1::LmHeadUpdate> put =
          as_message ? updates.Put(message) : updates.PutRows(target, row_begin, n, dtype, columns, *source);
      if (!put.ok()) {
        CHECK(Is(put.status(), {absl::StatusCode::kNotFound, absl::StatusCode::kInvalidArgument,
                                absl::StatusCode::kDataLoss, absl::StatusCode::kFailedPrecondition}) ||
              (source_kind == 1 && stage_failed && Is(put.status(), {absl::StatusCode::kInternal})));
        continue;
      }
      CHECK(target == id && row_begin >= 0 && n > 0 && row_begin + n <= kV && dtype == v1::F32 && columns == kH);
      CHECK(readable);
      CHECK(source_kind != 1 || (workers.stage && !stage_failed));
      CHECK(!content.empty() && static_cast<int64_t>(content.size()) == n * kRowBytes);
      // A retried put (exactly a range received whole, the same bytes) is
      // answered OK and counts once; any other overlap is refused.
      const auto whole = puts.find({row_begin, n});
      if (whole != puts.end() && whole->second == content) continue;
      for (int64_t r = 0; r < n; ++r) {
        CHECK(given[row_begin + r] == 0);  // exactly once
        ++given[row_begin + r];
        rows[row_begin + r] = content.substr(static_cast<size_t>(r * kRowBytes), kRowBytes);
      }
      puts[{row_begin, n}] = content;
    } else if (what <= 8) {
      const size_t loads_before = loaded.size();
      const absl::StatusOr<v1::LmHeadInfo> info = updates.Commit(target);
      if (!info.ok()) {
        CHECK(Is(info.status(), {absl::StatusCode::kNotFound, absl::StatusCode::kFailedPrecondition,
                                 absl::StatusCode::kInvalidArgument, absl::StatusCode::kUnavailable}));
        CHECK(heads.Bind("default", "").value()->version == "initial");
        if (target == id && !absl::IsNotFound(info.status())) ended = true;  // a failed commit aborts
        continue;
      }
      CHECK(target == id);
      for (int r = 0; r < kV; ++r) CHECK(given[r] == 1);
      CHECK(loaded.size() == loads_before + 1 && loaded.back() == begin.version());
      const std::shared_ptr<const logprob::LmHeadVersion> now = heads.Bind("default", "").value();
      CHECK(now->version == begin.version() && info->version() == begin.version());
      std::string all;
      for (const std::string& r : rows) all += r;
      CHECK(ReadFile(now->source.file, now->source.data_offset, all.size()) == all);
      CHECK(!logprob::FirstNonFinite(v1::F32, all.data(), kV * kH).has_value());  // NaN / Inf never commit
      logprob::Sha256Stream sha;
      sha.Update(all);
      CHECK(now->sha256.get() == sha.FinishHex());  // waits for a digest computing in the background
      ended = true;
    } else {
      const absl::StatusOr<v1::LmHeadUpdate> aborted = updates.Abort(target);
      if (!aborted.ok()) {
        CHECK(Is(aborted.status(), {absl::StatusCode::kNotFound}));
        continue;
      }
      CHECK(target == id);
      CHECK(heads.Bind("default", "").value()->version == "initial");
      ended = true;
    }
  }
}  // ~LmHeadUpdates aborts what is open and removes its files
