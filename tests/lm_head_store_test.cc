// The lm_head store's spare files (server/heads/lm_head_store.h): a released
// version's file is kept for its head's next update, which writes into it
// (no fresh pages); spares unused for long are removed, except each head's
// newest, so a trainer that updates less often than that still reuses one.
#include "server/heads/lm_head_store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

namespace logprob {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kSize = 1 << 20;

class LmHeadStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/lm_head_store_test." + std::to_string(getpid()) + "." +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  /// Stages a file of `size` bytes for `head` at a new stem, writes
  /// `mark` into its first byte through the store's mapping and returns the
  /// version that commits it; *was is the byte found there first (0 in a
  /// new file, a spare's mark in a reused one).
  LmHeadVersion Staged(LmHeadStore& store, const std::string& head, uint64_t size, char mark, char* was) {
    const std::string path = store.NewStem(head) + ".safetensors";
    FileMap map;
    const int fd = store.StagedFile(head, path, size, &map);
    EXPECT_GE(fd, 0) << path << ": " << std::strerror(errno);
    struct stat st {};
    EXPECT_EQ(fstat(fd, &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), size);
    close(fd);
    EXPECT_NE(map, nullptr);
    if (map != nullptr) {
      *was = map.get()[0];
      map.get()[0] = mark;
    }
    LmHeadVersion v;
    v.head = head;
    v.version = path;
    v.source.file = path;
    return v;
  }

  /// The marks (first bytes) of the files in the store's folder.
  std::multiset<char> Files() const {
    std::multiset<char> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      std::ifstream f(e.path(), std::ios::binary);
      char c = 0;
      if (f.get(c)) out.insert(c);
    }
    return out;
  }

  std::string dir_;
};

TEST_F(LmHeadStoreTest, IdleSparesGoButEachHeadsNewestStaysForTheNextUpdate) {
  LmHeadStore store(dir_, /*spare_idle=*/std::chrono::seconds(0));  // every spare is idle at once
  char was = 1;
  const LmHeadVersion va = Staged(store, "policy", kSize, 'a', &was);
  EXPECT_EQ(was, 0) << "a new file";
  const LmHeadVersion vb = Staged(store, "policy", kSize, 'b', &was);
  store.Recycle(va, /*dropped=*/true);
  store.Recycle(vb, /*dropped=*/true);
  EXPECT_EQ(Files(), (std::multiset<char>{'a', 'b'}));  // both kept as spares
  store.Tidy();
  EXPECT_EQ(Files(), (std::multiset<char>{'b'})) << "the older idle spare goes, the newest stays";
  store.Tidy();
  EXPECT_EQ(Files(), (std::multiset<char>{'b'}));
  // The next update writes into it.
  const LmHeadVersion vc = Staged(store, "policy", kSize, 'c', &was);
  EXPECT_EQ(was, 'b');
  EXPECT_EQ(Files(), (std::multiset<char>{'c'}));
  EXPECT_TRUE(fs::exists(vc.source.file));
}

TEST_F(LmHeadStoreTest, SparesNotIdleForLongStayAndEachHeadKeepsItsOwn) {
  LmHeadStore store(dir_, /*spare_idle=*/std::chrono::hours(1));
  char was = 1;
  const LmHeadVersion va = Staged(store, "policy", kSize, 'a', &was);
  const LmHeadVersion vb = Staged(store, "policy", kSize, 'b', &was);
  const LmHeadVersion vr = Staged(store, "reference", kSize, 'r', &was);
  store.Recycle(va, true);
  store.Recycle(vb, true);
  store.Recycle(vr, true);
  store.Tidy();
  EXPECT_EQ(Files(), (std::multiset<char>{'a', 'b', 'r'}));
  Staged(store, "reference", kSize, 's', &was);
  EXPECT_EQ(was, 'r') << "a head reuses its own spare";
  Staged(store, "policy", kSize, 'p', &was);
  EXPECT_EQ(was, 'b') << "the newest spare first";
}

TEST_F(LmHeadStoreTest, AVersionAWorkerStillMapsOrOfAnotherSizeLeavesNoSpare) {
  LmHeadStore store(dir_, std::chrono::hours(1));
  char was = 1;
  const LmHeadVersion va = Staged(store, "policy", kSize, 'a', &was);
  store.Recycle(va, /*dropped=*/false);  // a worker may still read it: removed, never rewritten
  EXPECT_TRUE(Files().empty());
  const LmHeadVersion vb = Staged(store, "policy", kSize, 'b', &was);
  EXPECT_EQ(was, 0);
  store.Recycle(vb, true);
  Staged(store, "policy", 2 * kSize, 'c', &was);  // another size: a new file, the spare removed
  EXPECT_EQ(was, 0);
  EXPECT_EQ(Files(), (std::multiset<char>{'c'}));
}

}  // namespace
}  // namespace logprob
