// BufferRecycler (common/buffer_recycler.h) against a counting fake
// allocator: a released buffer becomes the next Take's of its size, at most
// max_idle idle ones are kept, buffers outliving the recycler are freed by
// their holders, allocation errors pass through. CPU only: the logic the
// CUDA backend's per-version device buffers rely on.
#include "common/buffer_recycler.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <thread>
#include <vector>

namespace logprob {
namespace {

/// malloc / free, counting live buffers; Allocate fails while `fail` is
/// set. Thread-safe (buffers are freed from the threads that release them).
struct FakeAlloc {
  static inline absl::Mutex mu;
  static inline std::set<void*> live;
  static inline bool fail = false;
  static absl::Status Allocate(void** p, size_t bytes) {
    if (fail) return absl::ResourceExhaustedError("fake: out of memory");
    *p = std::malloc(bytes);
    absl::MutexLock lock(&mu);
    live.insert(*p);
    return absl::OkStatus();
  }
  static void Free(void* p) {
    {
      absl::MutexLock lock(&mu);
      EXPECT_EQ(live.erase(p), 1u) << "freed twice or never allocated";
    }
    std::free(p);
  }
};

class BufferRecyclerTest : public testing::Test {
 protected:
  void SetUp() override {
    FakeAlloc::live.clear();
    FakeAlloc::fail = false;
  }
  void TearDown() override { EXPECT_TRUE(FakeAlloc::live.empty()) << FakeAlloc::live.size() << " leaked"; }
};

TEST_F(BufferRecyclerTest, AReleasedBufferIsTheNextTakeOfItsSize) {
  BufferRecycler<FakeAlloc> r(/*max_idle=*/1);
  auto a = r.Take(1000);
  ASSERT_TRUE(a.ok()) << a.status();
  void* first = a->get();
  static_cast<char*>(first)[0] = 42;
  a->reset();  // the version is released
  EXPECT_EQ(r.idle_bytes(), 1000u);
  EXPECT_EQ(FakeAlloc::live.size(), 1u);
  auto b = r.Take(1000);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->get(), first);  // the same memory, pages already touched
  EXPECT_EQ(static_cast<char*>(b->get())[0], 42);
  EXPECT_EQ(r.allocated(), 1u);
  EXPECT_EQ(r.reused(), 1u);
  EXPECT_EQ(r.idle_bytes(), 0u);
  // Another size never takes it.
  auto c = r.Take(999);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->get(), first);
  EXPECT_EQ(r.allocated(), 2u);
}

TEST_F(BufferRecyclerTest, KeepsAtMostMaxIdleOfEachSizeAndFreesTheRest) {
  BufferRecycler<FakeAlloc> r(/*max_idle=*/1);
  std::vector<BufferRecycler<FakeAlloc>::Buffer> held;
  for (int i = 0; i < 3; ++i) {
    auto b = r.Take(64);
    ASSERT_TRUE(b.ok());
    held.push_back(*std::move(b));
  }
  EXPECT_EQ(FakeAlloc::live.size(), 3u);
  held.clear();  // three versions released: one kept, two freed
  EXPECT_EQ(FakeAlloc::live.size(), 1u);
  EXPECT_EQ(r.idle_bytes(), 64u);

  BufferRecycler<FakeAlloc> none(/*max_idle=*/0);
  auto b = none.Take(64);
  ASSERT_TRUE(b.ok());
  b->reset();
  EXPECT_EQ(none.idle_bytes(), 0u);
  EXPECT_EQ(FakeAlloc::live.size(), 1u);  // only r's idle one
}

TEST_F(BufferRecyclerTest, BuffersOutlivingTheRecyclerAreFreedByTheirHolders) {
  BufferRecycler<FakeAlloc>::Buffer kept;
  {
    BufferRecycler<FakeAlloc> r;
    auto held = r.Take(32 * 2), idle = r.Take(32);  // 32: the latest size, kept idle
    ASSERT_TRUE(idle.ok() && held.ok());
    idle->reset();
    kept = *std::move(held);
    EXPECT_EQ(FakeAlloc::live.size(), 2u);
  }  // the idle buffer is freed with the recycler
  EXPECT_EQ(FakeAlloc::live.size(), 1u);
  kept.reset();  // freed, not returned to a recycler that is gone
  EXPECT_TRUE(FakeAlloc::live.empty());
}

TEST_F(BufferRecyclerTest, ErrorsPassThroughAndZeroBytesIsInvalid) {
  BufferRecycler<FakeAlloc> r;
  EXPECT_EQ(r.Take(0).status().code(), absl::StatusCode::kInvalidArgument);
  FakeAlloc::fail = true;
  auto b = r.Take(16);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.allocated(), 0u);
  FakeAlloc::fail = false;
}

TEST_F(BufferRecyclerTest, ReleasesFromOtherThreadsAreTakenBack) {
  BufferRecycler<FakeAlloc> r(/*max_idle=*/2);
  std::vector<BufferRecycler<FakeAlloc>::Buffer> held;
  for (int i = 0; i < 4; ++i) held.push_back(*r.Take(128));
  std::vector<std::thread> threads;
  for (auto& b : held) threads.emplace_back([&b] { b.reset(); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(r.idle_bytes(), 2u * 128);
  EXPECT_EQ(FakeAlloc::live.size(), 2u);
  auto again = r.Take(128);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(r.reused(), 1u);
}

// Issue 50: a vocabulary or precision change gives the head's buffers a new
// size; the old size's buffers are freed once no version holds one, not
// kept idle for good.
TEST_F(BufferRecyclerTest, AnOldSizeIsFreedOnceNoVersionHoldsIt) {
  BufferRecycler<FakeAlloc> r(/*max_idle=*/1);
  auto v1 = r.Take(1000), v2 = r.Take(1000);
  ASSERT_TRUE(v1.ok() && v2.ok());
  v1->reset();  // v2 holds the size: kept for v3
  EXPECT_EQ(r.idle_bytes(), 1000u);
  auto v3 = r.Take(800);  // the new vocabulary, while v2 still serves
  ASSERT_TRUE(v3.ok());
  EXPECT_EQ(r.idle_bytes(), 1000u);  // v2's size is still held
  v2->reset();                       // the last version of the old size goes: so does its idle buffer
  EXPECT_EQ(r.idle_bytes(), 0u);
  EXPECT_EQ(FakeAlloc::live.size(), 1u);  // v3 alone
  // The new size recycles as before.
  auto v4 = r.Take(800);
  ASSERT_TRUE(v4.ok());
  v3->reset();
  EXPECT_EQ(r.idle_bytes(), 800u);
  auto v5 = r.Take(800);
  ASSERT_TRUE(v5.ok());
  EXPECT_EQ(r.reused(), 1u);  // v3's buffer (v1's was freed with its size)
}

// A staging buffer is held only during a load: kept between loads as the
// latest size, freed by a Take of another size or TrimIdle.
TEST_F(BufferRecyclerTest, TheLatestSizeIsKeptUntilAnotherSizeOrTrimIdle) {
  BufferRecycler<FakeAlloc> r(/*max_idle=*/1);
  (void)r.Take(64);  // taken and returned at once
  EXPECT_EQ(r.idle_bytes(), 64u);
  (void)r.Take(64);
  EXPECT_EQ(r.reused(), 1u);
  EXPECT_EQ(r.idle_bytes(), 64u);
  (void)r.Take(48);  // another size: the idle 64 goes first
  EXPECT_EQ(r.idle_bytes(), 48u);
  EXPECT_EQ(FakeAlloc::live.size(), 1u);
  r.TrimIdle(0);  // a load that needs no staging
  EXPECT_EQ(r.idle_bytes(), 0u);
  EXPECT_TRUE(FakeAlloc::live.empty());
}

// Heads of two sizes updated in turn: each size is held, so each keeps its
// idle buffer.
TEST_F(BufferRecyclerTest, SizesStillHeldKeepTheirIdleBuffers) {
  BufferRecycler<FakeAlloc> r(/*max_idle=*/1);
  auto a1 = r.Take(100), b1 = r.Take(200);
  ASSERT_TRUE(a1.ok() && b1.ok());
  for (int round = 0; round < 3; ++round) {
    auto a2 = r.Take(100);
    ASSERT_TRUE(a2.ok());
    std::swap(*a1, *a2);
    a2->reset();
    auto b2 = r.Take(200);
    ASSERT_TRUE(b2.ok());
    std::swap(*b1, *b2);
    b2->reset();
  }
  EXPECT_EQ(r.idle_bytes(), 300u);
  EXPECT_EQ(r.allocated(), 4u);  // one spare of each size, reused every round after the first
}

}  // namespace
}  // namespace logprob
