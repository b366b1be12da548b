// How a worker stages lm_head update rows from device memory into the
// store file (worker/heads/device_file_copy.h, Worker.StageLmHeadRows), on the
// CPU: "device memory" is host memory (tests/fake_device_copy.h). The
// bytes that land at the file offset (and nothing around them), the
// chunking, and failures (an injected copy failure, a write failure, a
// CPU backend, a range outside the file) reported, never a short write.
#include "worker/heads/device_file_copy.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "tests/fake_device_copy.h"
#include "worker/scoring/cpu_backend.h"
#include "worker/worker_service.h"

namespace logprob::testing {
namespace {

/// A file of `size` bytes of `fill` in the test's temporary directory,
/// removed with the object.
/// The lm_head store folder the staging tests write in (the test's temp
/// folder, without a trailing '/').
std::string Store() {
  std::string dir = ::testing::TempDir();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

/// A staged file of Store() ("<name>.partial"), removed at the end.
class TempFile {
 public:
  TempFile(size_t size, char fill)
      : path_(Store() + "/device_file_copy_test." + std::to_string(getpid()) + "." + std::to_string(next_++) +
              ".partial") {
    std::ofstream(path_, std::ios::binary) << std::string(size, fill);
  }
  ~TempFile() { unlink(path_.c_str()); }
  const std::string& path() const { return path_; }
  std::string Contents() const {
    std::ifstream in(path_, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

 private:
  static inline int next_ = 0;
  const std::string path_;
};

/// `n` bytes that differ from their neighbours and from any fill byte used here.
std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(1 + (i * 7 + i / 251) % 200);
  return s;
}

TEST(CopyDeviceToFileTest, WritesEveryByteAtTheOffsetInChunksAndNothingAround) {
  const std::string device = Pattern(10 * 1000 + 7);
  constexpr size_t kBefore = 123, kAfter = 50;
  TempFile file(kBefore + device.size() + kAfter, '\xEE');
  const int fd = open(file.path().c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  FakeDeviceCopy copy;
  std::vector<char> buffer;
  const absl::Status st = CopyDeviceToFile(copy, device.data(), device.size(), fd, kBefore, &buffer, 1000);
  close(fd);
  ASSERT_TRUE(st.ok()) << st;
  const std::string got = file.Contents();
  ASSERT_EQ(got.size(), kBefore + device.size() + kAfter);
  EXPECT_EQ(got.substr(0, kBefore), std::string(kBefore, '\xEE'));
  EXPECT_EQ(got.substr(kBefore, device.size()), device);
  EXPECT_EQ(got.substr(kBefore + device.size()), std::string(kAfter, '\xEE'));
  // 10 whole chunks and the 7-byte tail, in order, each from its own place.
  ASSERT_EQ(copy.calls.size(), 11u);
  for (size_t i = 0; i < copy.calls.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_FALSE(copy.calls[i].to_device);
    EXPECT_EQ(copy.calls[i].device, device.data() + i * 1000);
    EXPECT_EQ(copy.calls[i].bytes, i < 10 ? 1000u : 7u);
  }
  EXPECT_EQ(buffer.size(), 1000u);  // bounded by the chunk, kept for the next call
}

TEST(CopyDeviceToFileTest, AFewBytesAreOneCopyWithABufferOfTheirSize) {
  const std::string device = Pattern(40);
  TempFile file(64, '\0');
  const int fd = open(file.path().c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  FakeDeviceCopy copy;
  std::vector<char> buffer;
  ASSERT_TRUE(CopyDeviceToFile(copy, device.data(), device.size(), fd, 8, &buffer).ok());
  close(fd);
  EXPECT_EQ(copy.calls.size(), 1u);
  EXPECT_EQ(buffer.size(), 40u);
  EXPECT_EQ(file.Contents().substr(8, 40), device);
}

TEST(CopyDeviceToFileTest, AFailedCopyIsReportedWithItsChunkAndStopsThere) {
  const std::string device = Pattern(5000);
  TempFile file(device.size(), '\xEE');
  const int fd = open(file.path().c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  FakeDeviceCopy copy;
  copy.fail_to_host_after = 3;  // the 4th chunk fails
  std::vector<char> buffer;
  const absl::Status st = CopyDeviceToFile(copy, device.data(), device.size(), fd, 0, &buffer, 1000);
  close(fd);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("copying bytes [3000, 4000) of 5000 from the device: injected ToHost failure"),
            std::string::npos)
      << st;
  EXPECT_EQ(copy.calls.size(), 4u);  // nothing after the failure
  EXPECT_EQ(file.Contents().substr(3000), std::string(2000, '\xEE'));
}

TEST(CopyDeviceToFileTest, AFailedWriteIsReportedWithErrno) {
  const std::string device = Pattern(100);
  TempFile file(100, '\0');
  const int fd = open(file.path().c_str(), O_RDONLY | O_CLOEXEC);  // pwrite: EBADF
  ASSERT_GE(fd, 0);
  FakeDeviceCopy copy;
  std::vector<char> buffer;
  const absl::Status st = CopyDeviceToFile(copy, device.data(), device.size(), fd, 0, &buffer);
  close(fd);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_NE(st.message().find("writing bytes [0, 100) of 100 at file offset 0: Bad file descriptor"), std::string::npos)
      << st;
}

TEST(CopyDeviceToFileTest, NothingToCopyAndABadChunk) {
  FakeDeviceCopy copy;
  std::vector<char> buffer;
  EXPECT_TRUE(CopyDeviceToFile(copy, nullptr, 0, -1, 0, &buffer).ok());
  EXPECT_TRUE(copy.calls.empty());
  const char one = 1;
  EXPECT_EQ(CopyDeviceToFile(copy, &one, 1, -1, 0, &buffer, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CopyDeviceToFile(copy, nullptr, 1, -1, 0, &buffer).code(), absl::StatusCode::kInvalidArgument);
}

/// A backend whose "GPU" is host memory: a CUDA IPC handle is the address
/// of a std::string holding the allocation (tests only), copies are a
/// FakeDeviceCopy. Scoring is not its business.
class HostGpuBackend final : public ScoringBackend {
 public:
  std::string name() const override { return "host-gpu"; }
  absl::Status SlicePartials(const LogitsBlock&, const BlockRows&, const kernels::StatsSpec&, uint32_t*) override {
    return absl::UnimplementedError("not here");
  }
  absl::Status FilteredRowPartials(const LogitsBlock&, const BlockRows&, const kernels::StatsSpec&,
                                   const SamplingFilter&, uint32_t*) override {
    return absl::UnimplementedError("not here");
  }
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice, LmHeadPrecision) override {
    return absl::UnimplementedError("not here");
  }
  absl::Status HiddenPartials(const LmHeadWeights&, DType, const void*, int64_t, const BlockRows&,
                              const kernels::StatsSpec&, uint32_t*) override {
    return absl::UnimplementedError("not here");
  }
  absl::Status HiddenLogits(const LmHeadWeights&, DType, const void*, int64_t, float*) override {
    return absl::UnimplementedError("not here");
  }
  absl::StatusOr<DevicePayload> OpenCudaIpcPayload(std::string_view handle, int64_t offset, int64_t bytes,
                                                   int64_t /*allocation_bytes*/) override {
    const std::string* alloc = nullptr;
    if (handle.size() != sizeof(alloc)) return absl::InvalidArgumentError("bad handle");
    std::memcpy(&alloc, handle.data(), sizeof(alloc));
    if (offset > static_cast<int64_t>(alloc->size()) || bytes > static_cast<int64_t>(alloc->size()) - offset)
      return absl::InvalidArgumentError("outside the allocation");
    return DevicePayload(std::shared_ptr<const char>(), alloc->data() + offset);
  }
  absl::StatusOr<std::unique_ptr<DeviceCopy>> NewDeviceCopy() override {
    auto copy = std::make_unique<FakeDeviceCopy>();
    copy->fail_to_host = fail;
    return std::unique_ptr<DeviceCopy>(std::move(copy));
  }
  bool fail = false;
};

internal::v1::LmHeadStage Stage(const std::string& alloc, int64_t offset, int64_t bytes, const std::string& file,
                                int64_t file_offset) {
  internal::v1::LmHeadStage s;
  const std::string* p = &alloc;
  s.mutable_source()->set_handle(std::string(reinterpret_cast<const char*>(&p), sizeof(p)));
  s.mutable_source()->set_offset(offset);
  s.mutable_source()->set_byte_size(bytes);
  s.set_file(file);
  s.set_file_offset(file_offset);
  return s;
}

TEST(StageLmHeadRowsTest, CopiesTheReferencedBytesToTheFileOffset) {
  const std::string alloc = Pattern(3000);
  TempFile file(2000, '\xEE');
  HostGpuBackend backend;
  const absl::StatusOr<int64_t> n = StageLmHeadRows(backend, Stage(alloc, 500, 1200, file.path(), 700), Store());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 1200);
  const std::string got = file.Contents();
  ASSERT_EQ(got.size(), 2000u);  // neither truncated nor extended
  EXPECT_EQ(got.substr(0, 700), std::string(700, '\xEE'));
  EXPECT_EQ(got.substr(700, 1200), alloc.substr(500, 1200));
  EXPECT_EQ(got.substr(1900), std::string(100, '\xEE'));
}

TEST(StageLmHeadRowsTest, RefusesWhatItCannotDoAndLeavesTheFileAlone) {
  const std::string alloc = Pattern(3000);
  TempFile file(2000, '\xEE');
  HostGpuBackend backend;
  // A range past the file's end: never extends it.
  absl::StatusOr<int64_t> n = StageLmHeadRows(backend, Stage(alloc, 0, 1200, file.path(), 900), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << n.status();
  EXPECT_NE(n.status().message().find("outside the file's 2000 bytes"), std::string::npos) << n.status();
  // Negative numbers.
  n = StageLmHeadRows(backend, Stage(alloc, 0, 10, file.path(), -1), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << n.status();
  // No such file: not created.
  const std::string missing = Store() + "/device_file_copy_test.missing." + std::to_string(getpid()) + ".partial";
  n = StageLmHeadRows(backend, Stage(alloc, 0, 10, missing, 0), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kNotFound) << n.status();
  EXPECT_NE(access(missing.c_str(), F_OK), 0);
  // A range outside the allocation (the backend's mapping refuses it).
  n = StageLmHeadRows(backend, Stage(alloc, 2500, 1000, file.path(), 0), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << n.status();
  // The device copy fails: an error, never a count.
  backend.fail = true;
  n = StageLmHeadRows(backend, Stage(alloc, 0, 100, file.path(), 0), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInternal) << n.status();
  EXPECT_NE(n.status().message().find("injected ToHost failure"), std::string::npos) << n.status();
  EXPECT_EQ(file.Contents(), std::string(2000, '\xEE'));
}

// Issue 42: a worker writes only the front-end's staged files, whatever
// path a call names: a file directly in the store folder, named
// "<name>.partial", opened without following links; refused before the
// backend is asked for anything.
TEST(StageLmHeadRowsTest, WritesOnlyTheStoresStagedFiles) {
  const std::string alloc = Pattern(100);
  HostGpuBackend backend;
  // A file outside the store (in a folder beside it), one in a subfolder,
  // a path through "..", a committed (not staged) file, a hidden one.
  const std::string outside_dir = Store() + "/device_file_copy_test.outside." + std::to_string(getpid());
  ASSERT_EQ(mkdir(outside_dir.c_str(), 0700), 0);
  const std::string outside = outside_dir + "/victim.partial";
  std::ofstream(outside, std::ios::binary) << std::string(100, '\x11');
  TempFile staged(100, '\xEE');
  const std::string committed = Store() + "/device_file_copy_test.committed." + std::to_string(getpid());
  std::ofstream(committed, std::ios::binary) << std::string(100, '\x22');
  for (const std::string& file : {outside, outside_dir + "/../" + staged.path().substr(Store().size() + 1), committed,
                                  Store() + "/.hidden.partial", std::string("/etc/passwd")}) {
    SCOPED_TRACE(file);
    const absl::StatusOr<int64_t> n = StageLmHeadRows(backend, Stage(alloc, 0, 100, file, 0), Store());
    EXPECT_EQ(n.status().code(), absl::StatusCode::kPermissionDenied) << n.status();
    EXPECT_NE(n.status().message().find("not a staged file (<name>.partial) directly in the front-end's lm_head store"),
              std::string::npos)
        << n.status();
  }
  // Another folder given as the store (what a worker of another front-end
  // holds) refuses this store's file; no store at all refuses everything.
  absl::StatusOr<int64_t> n = StageLmHeadRows(backend, Stage(alloc, 0, 100, staged.path(), 0), outside_dir);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kPermissionDenied) << n.status();
  n = StageLmHeadRows(backend, Stage(alloc, 0, 100, staged.path(), 0), "");
  EXPECT_EQ(n.status().code(), absl::StatusCode::kPermissionDenied) << n.status();
  EXPECT_NE(n.status().message().find("given no lm_head store folder"), std::string::npos) << n.status();
  // A link in the store named like a staged file is not followed.
  const std::string link = Store() + "/device_file_copy_test.link." + std::to_string(getpid()) + ".partial";
  ASSERT_EQ(symlink(outside.c_str(), link.c_str()), 0);
  n = StageLmHeadRows(backend, Stage(alloc, 0, 100, link, 0), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kNotFound) << n.status();
  // A FIFO named like a staged file: refused at once, never waited on
  // (a writer's open of a FIFO without a reader would block).
  const std::string fifo = Store() + "/device_file_copy_test.fifo." + std::to_string(getpid()) + ".partial";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  n = StageLmHeadRows(backend, Stage(alloc, 0, 100, fifo, 0), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kNotFound) << n.status();  // no reader: ENXIO
  {
    // With a reader the open succeeds; the file is still not a regular one.
    const int reader = open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
    ASSERT_GE(reader, 0);
    n = StageLmHeadRows(backend, Stage(alloc, 0, 100, fifo, 0), Store());
    EXPECT_EQ(n.status().code(), absl::StatusCode::kFailedPrecondition) << n.status();
    EXPECT_NE(n.status().message().find("not a regular file"), std::string::npos) << n.status();
    close(reader);
  }
  unlink(fifo.c_str());
  // Nothing was written anywhere; the staged file itself still takes rows.
  std::ifstream in(outside, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), std::string(100, '\x11'));
  EXPECT_EQ(staged.Contents(), std::string(100, '\xEE'));
  n = StageLmHeadRows(backend, Stage(alloc, 0, 100, staged.path(), 0), Store());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(staged.Contents(), alloc);
  unlink(link.c_str());
  unlink(committed.c_str());
  unlink(outside.c_str());
  rmdir(outside_dir.c_str());
}

TEST(StageLmHeadRowsTest, ACpuWorkerHasNoDeviceToCopyFrom) {
  const std::string alloc = Pattern(100);
  TempFile file(100, '\xEE');
  CpuBackend backend(1);
  const absl::StatusOr<int64_t> n = StageLmHeadRows(backend, Stage(alloc, 0, 100, file.path(), 0), Store());
  EXPECT_EQ(n.status().code(), absl::StatusCode::kFailedPrecondition) << n.status();
  EXPECT_NE(n.status().message().find("backend (cpu) has no device memory"), std::string::npos) << n.status();
  EXPECT_EQ(file.Contents(), std::string(100, '\xEE'));
}

}  // namespace
}  // namespace logprob::testing
