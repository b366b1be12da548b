// LmHeadUpdates without a server: the findings of fuzz_lm_head_update stay
// fixed (a server stopping with an update open; row ranges whose end does
// not fit in int64).
#include "server/lm_head_updates.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>

#include "server/input_source.h"
#include "server/lm_heads.h"

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

  std::unique_ptr<LmHeadUpdates> Make() {
    LmHeadUpdates::Options o;
    o.allowed = true;
    o.store_dir = store_;
    o.workers = 2;
    LmHeadWorkers w;
    w.load = [](const internal::v1::LmHeadLoad&) -> absl::StatusOr<int64_t> { return 0; };
    w.serving = [](int64_t) { return true; };
    w.drop = [](const internal::v1::LmHeadRef&) {};
    return std::make_unique<LmHeadUpdates>(o, &heads_, std::make_shared<LmHeadReleases>(), w);
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
  size_t StoreFiles() const {
    return static_cast<size_t>(std::distance(std::filesystem::directory_iterator(store_), {}));
  }

  std::string store_;
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

}  // namespace
}  // namespace logprob
