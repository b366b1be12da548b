// StagedFileHasher: the SHA-256 of a staged file's bytes, hashed in order
// on its own thread while ranges are written in any order.
#include "server/heads/staged_file_hasher.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/sha256.h"

namespace logprob {
namespace {

/// A temporary file of `bytes` bytes (zeros until the test writes them).
class TempFile {
 public:
  explicit TempFile(size_t bytes) {
    char path[] = "/tmp/staged_file_hasher_XXXXXX";
    fd_ = mkstemp(path);
    path_ = path;
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
  }
  ~TempFile() {
    close(fd_);
    unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  void Write(const std::string& bytes, size_t at) {
    ASSERT_EQ(pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(at)), static_cast<ssize_t>(bytes.size()));
  }

 private:
  int fd_ = -1;
  std::string path_;
};

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

TEST(StagedFileHasher, RangesWrittenOutOfOrderFromThreadsHashLikeTheWholeData) {
  constexpr size_t kHeader = 24, kData = (size_t{9} << 20) + 12345;  // several 4 MiB reads, a ragged end
  const std::string data = RandomBytes(kData, 1);
  TempFile f(kHeader + kData);
  f.Write(std::string(kHeader, 'h'), 0);  // not hashed
  StagedFileHasher hasher(f.fd(), kHeader, kData);
  // 37 ranges of uneven sizes, written by 3 threads in shuffled order.
  std::vector<std::pair<size_t, size_t>> ranges;
  for (size_t b = 0; b < kData;) {
    const size_t e = std::min(kData, b + 1 + (b * 7919) % (size_t{700} << 10));
    ranges.emplace_back(b, e);
    b = e;
  }
  std::shuffle(ranges.begin(), ranges.end(), std::mt19937(2));
  std::vector<std::thread> writers;
  for (size_t t = 0; t < 3; ++t)
    writers.emplace_back([&, t] {
      for (size_t i = t; i < ranges.size(); i += 3) {
        const auto [b, e] = ranges[i];
        f.Write(data.substr(b, e - b), kHeader + b);
        hasher.Written(static_cast<int64_t>(b), static_cast<int64_t>(e));
      }
    });
  for (auto& w : writers) w.join();
  const absl::StatusOr<std::string> digest = hasher.Finish();
  ASSERT_TRUE(digest.ok()) << digest.status();
  EXPECT_EQ(*digest, Sha256Hex(data));
}

TEST(StagedFileHasher, AFileThatEndsEarlyIsAnError) {
  TempFile f(100);  // 100 bytes, 200 announced
  StagedFileHasher hasher(f.fd(), 0, 200);
  hasher.Written(0, 200);
  const absl::StatusOr<std::string> digest = hasher.Finish();
  EXPECT_EQ(digest.status().code(), absl::StatusCode::kInternal) << digest.status();
  EXPECT_NE(digest.status().message().find("for its sha256 failed at byte 0"), std::string::npos) << digest.status();
}

TEST(StagedFileHasher, DestroyedWithRowsMissingReturnsAtOnce) {
  TempFile f(64);
  auto hasher = std::make_unique<StagedFileHasher>(f.fd(), 0, 64);
  hasher->Written(32, 64);  // [0, 32) never comes (an aborted update)
  hasher.reset();           // joins its thread: must not wait for the gap (ctest's timeout would fail it)
}

}  // namespace
TEST(StagedFileHasher, InTheBackgroundItHashesAfterStartAndAfterTheCallerClosedItsFd) {
  const std::string data = RandomBytes((size_t{5} << 20) + 7, 3);
  TempFile f(data.size());
  f.Write(data, 0);
  const int fd = dup(f.fd());
  StagedFileHasher hasher(fd, 0, static_cast<int64_t>(data.size()), /*background=*/true);
  close(fd);  // the hasher reads through its own duplicate (an update ends before its hash)
  const std::shared_future<std::string> digest = hasher.digest();
  hasher.Written(0, static_cast<int64_t>(data.size()));
  // Nothing is hashed before Start (the rows' transfer keeps the machine).
  EXPECT_NE(digest.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  hasher.Start();
  EXPECT_EQ(digest.get(), Sha256Hex(data));
  EXPECT_EQ(hasher.Finish().value(), Sha256Hex(data));
}

TEST(StagedFileHasher, TheDigestFutureIsEmptyWhenDestroyedOrFailed) {
  std::shared_future<std::string> abandoned, failed;
  {
    TempFile f(64);
    StagedFileHasher hasher(f.fd(), 0, 64);
    abandoned = hasher.digest();
    hasher.Written(0, 32);  // half: the rest never comes
  }
  EXPECT_EQ(abandoned.get(), "");
  {
    TempFile f(100);
    StagedFileHasher hasher(f.fd(), 0, 200);
    failed = hasher.digest();
    hasher.Written(0, 200);
    EXPECT_FALSE(hasher.Finish().ok());
  }
  EXPECT_EQ(failed.get(), "");
}

}  // namespace logprob
