// CopyFromMappedFile: bytes of a mapped tmpfs file copy as memcpy would; a
// file truncated under its mapping fails the copy (no SIGBUS reaches the
// process), on any thread, any number of times.
#include "common/mapped_file_copy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace logprob {
namespace {

TEST(CopyFromMappedFile, CopiesAndFailsOnceTheFileShrankBelowTheBytes) {
  const std::string path = "/dev/shm/mapped_file_copy_test." + std::to_string(getpid());
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  constexpr size_t kPage = 4096, kBytes = 64 * kPage;
  std::string bytes(kBytes, '\0');
  for (size_t i = 0; i < kBytes; ++i) bytes[i] = static_cast<char>(i * 7 + 3);
  ASSERT_EQ(pwrite(fd, bytes.data(), kBytes, 0), static_cast<ssize_t>(kBytes));
  const char* map = static_cast<const char*>(mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd, 0));
  ASSERT_NE(map, MAP_FAILED);
  std::string out(kBytes, 'x');
  EXPECT_TRUE(CopyFromMappedFile(out.data(), map, kBytes));
  EXPECT_EQ(out, bytes);
  EXPECT_TRUE(CopyFromMappedFile(out.data(), map, 0));

  // The owner truncates: pages past the new end fault.
  ASSERT_EQ(ftruncate(fd, 10 * kPage), 0);
  EXPECT_TRUE(CopyFromMappedFile(out.data(), map + kPage, 9 * kPage)) << "still within the file";
  EXPECT_FALSE(CopyFromMappedFile(out.data(), map, kBytes));
  EXPECT_FALSE(CopyFromMappedFile(out.data(), map + 20 * kPage, kPage));
  // From other threads too, several times each.
  std::vector<std::thread> threads;
  std::vector<int> failed(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::string mine(kBytes, '\0');
      for (int i = 0; i < 50; ++i) failed[t] += CopyFromMappedFile(mine.data(), map + 5 * kPage, 20 * kPage) ? 0 : 1;
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed, std::vector<int>(4, 50));
  // Grown again: the copy succeeds (the new bytes are zeros).
  ASSERT_EQ(ftruncate(fd, kBytes), 0);
  EXPECT_TRUE(CopyFromMappedFile(out.data(), map, kBytes));
  EXPECT_EQ(out.substr(0, 10 * kPage), bytes.substr(0, 10 * kPage));
  EXPECT_EQ(out.substr(10 * kPage), std::string(kBytes - 10 * kPage, '\0'));
  munmap(const_cast<char*>(map), kBytes);
  close(fd);
  std::remove(path.c_str());
}

TEST(CopyFromMappedFileDeathTest, ASigbusOutsideACopyStillEndsTheProcess) {
  // The handler takes only faults inside a copy of the faulting range.
  const std::string path = "/dev/shm/mapped_file_copy_death." + std::to_string(getpid());
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 8192), 0);
  const char* map = static_cast<const char*>(mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0));
  ASSERT_NE(map, MAP_FAILED);
  std::string out(8192, '\0');
  ASSERT_TRUE(CopyFromMappedFile(out.data(), map, 4096));  // the handler is installed
  ASSERT_EQ(ftruncate(fd, 0), 0);
  std::remove(path.c_str());
  EXPECT_DEATH(
      {
        volatile char c = map[100];
        (void)c;
      },
      "");
  munmap(const_cast<char*>(map), 8192);
  close(fd);
}

}  // namespace
}  // namespace logprob
