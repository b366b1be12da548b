// StandbyMappings: a released mapping of a tmpfs file range is handed out
// again for the same file and range (showing the file's current bytes),
// bounded in number, and unmapped once its file is removed.
#include "common/standby_mappings.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "common/host_bytes.h"
#include "common/positioned_io.h"
#include "gtest/gtest.h"

namespace logprob {
namespace {

class StandbyMappingsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) {
      paths_[i] = "/dev/shm/standby_mappings_test." + std::to_string(getpid()) + "." + std::to_string(i);
      Write(i, 0, std::string(3 * 4096, static_cast<char>('a' + i)));
    }
  }
  void TearDown() override {
    for (const std::string& p : paths_) std::remove(p.c_str());
  }
  void Write(int i, uint64_t offset, const std::string& bytes) {
    const int fd = open(paths_[i].c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(PwriteAll(fd, bytes.data(), bytes.size(), offset));
    close(fd);
  }
  std::string paths_[3];
};

TEST_F(StandbyMappingsTest, AReleasedMappingOfTheSameRangeIsReusedAndShowsTheFilesCurrentBytes) {
  StandbyMappings pool(4);
  const char* first = nullptr;
  {
    absl::StatusOr<HostBytes> a = HostBytes::MapMemoryFile(paths_[0], 4096 + 10, 100, &pool);
    if (absl::IsUnimplemented(a.status())) GTEST_SKIP() << a.status();  // /dev/shm is not tmpfs here
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(std::string(a->data(), 3), "aaa");
    first = a->data();
    const HostBytes copy = *a;  // copies share the mapping: it returns when the last goes
    EXPECT_EQ(pool.standby(), 0u);
  }
  EXPECT_EQ(pool.standby(), 1u);
  // The file's next contents (the store rewrote a recycled file), then the
  // same range: the same mapping, the new bytes.
  Write(0, 4096 + 10, "next version");
  absl::StatusOr<HostBytes> b = HostBytes::MapMemoryFile(paths_[0], 4096 + 10, 100, &pool);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->data(), first);
  EXPECT_EQ(std::string(b->data(), 12), "next version");
  EXPECT_EQ(pool.reused(), 1u);
  EXPECT_EQ(pool.standby(), 0u);
  // Another range of the same file, or the same range of another file: mapped anew.
  absl::StatusOr<HostBytes> c = HostBytes::MapMemoryFile(paths_[0], 2 * 4096, 100, &pool);
  absl::StatusOr<HostBytes> d = HostBytes::MapMemoryFile(paths_[1], 4096 + 10, 100, &pool);
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_EQ(std::string(c->data(), 2), "aa");
  EXPECT_EQ(std::string(d->data(), 2), "bb");
  EXPECT_EQ(pool.reused(), 1u);
}

TEST_F(StandbyMappingsTest, AtMostCapacityWaitAndOneWhoseFileWasRemovedIsUnmapped) {
  StandbyMappings pool(2);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<HostBytes> m = HostBytes::MapMemoryFile(paths_[i], 0, 4096, &pool);
    if (absl::IsUnimplemented(m.status())) GTEST_SKIP() << m.status();
    ASSERT_TRUE(m.ok()) << m.status();
  }
  EXPECT_EQ(pool.standby(), 2u);  // the oldest (file 0) went
  ASSERT_TRUE(HostBytes::MapMemoryFile(paths_[0], 0, 4096, &pool).ok());
  EXPECT_EQ(pool.reused(), 0u);
  // A file the store removed: its pages are not kept alive by a standby mapping.
  std::remove(paths_[2].c_str());
  EXPECT_EQ(pool.Sweep(), 1u);
  std::remove(paths_[1].c_str());
  std::remove(paths_[0].c_str());
  // The pool's own sweeper (every second) unmaps the rest.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (pool.standby() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // polling observed state
  EXPECT_EQ(pool.standby(), 0u);
}

TEST_F(StandbyMappingsTest, MappingsMayOutliveThePool) {
  absl::StatusOr<HostBytes> kept = absl::UnknownError("unset");
  {
    StandbyMappings pool(2);
    kept = HostBytes::MapMemoryFile(paths_[0], 0, 4096, &pool);
    if (absl::IsUnimplemented(kept.status())) GTEST_SKIP() << kept.status();
    ASSERT_TRUE(kept.ok()) << kept.status();
    HostBytes other = *HostBytes::MapMemoryFile(paths_[1], 0, 4096, &pool);
    (void)other;  // released into the pool, unmapped with it
  }
  EXPECT_EQ(std::string(kept->data(), 2), "aa");
  kept = absl::UnknownError("released");  // unmapped now (ASan: no use of the gone pool)
}

}  // namespace
}  // namespace logprob
