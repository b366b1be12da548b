// The front-end's shared pools and registries used from many threads at
// once: BufferPool (ScoreChunked request buffers), PayloadPool (payload
// regions), Admission and ClientRegions (shared-memory inputs). Each thread
// checks that what it holds is its own (a pattern written and read back),
// and the totals at the end are checked against what the threads did. The
// suite runs under ThreadSanitizer too (label "concurrency").
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/buffer_pool.h"
#include "server/core/admission.h"
#include "server/inputs/client_regions.h"
#include "server/pool/payload_pool.h"

namespace logprob {
namespace {

constexpr int kThreads = 8;
constexpr int kRounds = 200;

/// Runs fn(thread index) on kThreads threads and joins them.
template <typename Fn>
void OnThreads(Fn fn) {
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back([&fn, t] { fn(t); });
  for (auto& th : threads) th.join();
}

TEST(BufferPoolConcurrency, EveryBufferHasOneHolderAndTheIdleBoundHolds) {
  constexpr int64_t kMaxIdle = 64 << 10;
  BufferPool pool(kMaxIdle);
  std::atomic<int> foreign{0};
  OnThreads([&](int t) {
    for (int i = 0; i < kRounds; ++i) {
      const size_t n = 1024 * static_cast<size_t>(1 + (i + t) % 16);
      std::string b = pool.Acquire(n);
      ASSERT_EQ(b.size(), n);
      std::memset(b.data(), 'a' + t, n);
      std::this_thread::yield();
      for (char c : b)
        if (c != 'a' + t) {
          ++foreign;
          break;
        }
      pool.Release(std::move(b));
    }
  });
  EXPECT_EQ(foreign.load(), 0) << "a buffer was handed to two threads at once";
  EXPECT_GT(pool.idle_bytes(), 0);
  EXPECT_LE(pool.idle_bytes(), kMaxIdle);
}

TEST(PayloadPoolConcurrency, EveryRegionHasOneHolder) {
  PayloadPool pool(/*max_idle=*/2);
  std::atomic<int> foreign{0};
  OnThreads([&](int t) {
    for (int i = 0; i < kRounds / 4; ++i) {
      auto region = pool.Acquire(static_cast<size_t>(1 + (i % 3)) << 20);
      ASSERT_TRUE(region.ok()) << region.status();
      char* p = (*region)->data();
      const size_t n = (*region)->size();
      std::memset(p, 'a' + t, n);
      std::this_thread::yield();
      if (p[0] != 'a' + t || p[n / 2] != 'a' + t || p[n - 1] != 'a' + t) ++foreign;
    }
  });
  EXPECT_EQ(foreign.load(), 0) << "a region was handed to two threads at once";
}

TEST(AdmissionConcurrency, EveryTicketIsCountedOnceAndReleased) {
  std::atomic<int64_t> last_requests{-1};
  Admission admission(/*max_tokens=*/1000, /*max_bytes=*/1 << 20,
                      [&](int64_t requests, int64_t, int64_t) { last_requests = requests; });
  std::atomic<int> admitted{0}, refused{0};
  OnThreads([&](int) {
    for (int i = 0; i < kRounds; ++i) {
      auto ticket = admission.Admit(100, 1000);
      if (!ticket.ok()) {
        EXPECT_EQ(ticket.status().code(), absl::StatusCode::kResourceExhausted);
        ++refused;
        continue;
      }
      ++admitted;
      EXPECT_LE(admission.tokens(), 1000);
    }
  });
  EXPECT_EQ(admitted + refused, kThreads * kRounds);
  EXPECT_EQ(admission.tokens(), 0);
  EXPECT_EQ(admission.bytes(), 0);
  EXPECT_EQ(admission.requests(), 0);
  EXPECT_EQ(last_requests.load(), 0);
}

// Requests of unknown size reserve the largest one for their read: the
// next waits for room (the first shrinks to its size once read) instead of
// being refused; what never fits is refused at its deadline; a ticket
// grows and shrinks in place, counted once.
TEST(AdmissionReservations, AReservationWaitsForRoomAndBecomesTheRequestsShare) {
  Admission admission(/*max_tokens=*/1000, /*max_bytes=*/100);
  Admission::Ticket first, second;
  ASSERT_TRUE(admission.Resize(&first, 0, 80).ok());  // reading, size unknown
  EXPECT_EQ(admission.Resize(&second, 0, 80).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(admission.ResizeWaiting(&second, 0, 80, absl::Now()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(second.empty());
  std::thread reader([&] { ASSERT_TRUE(admission.Resize(&first, 0, 10).ok()); });  // read: 10 bytes
  ASSERT_TRUE(admission.ResizeWaiting(&second, 0, 80, absl::InfiniteFuture()).ok());
  reader.join();
  EXPECT_EQ(admission.bytes(), 90);
  EXPECT_EQ(admission.requests(), 2);
  // Admitted into the same ticket: tokens and bytes counted once.
  ASSERT_TRUE(admission.Resize(&first, 5, 12).ok());
  EXPECT_EQ(admission.bytes(), 92);
  EXPECT_EQ(admission.tokens(), 5);
  EXPECT_EQ(admission.Resize(&first, 5, 30).code(), absl::StatusCode::kResourceExhausted);  // 80 + 30 > 100
  EXPECT_EQ(first.bytes(), 12);
  { Admission::Ticket gone = std::move(second); }
  EXPECT_EQ(admission.bytes(), 12);
  EXPECT_EQ(admission.requests(), 1);
  // Alone in flight, a request may grow over the limit.
  EXPECT_TRUE(admission.Resize(&first, 5, 150).ok());
}

/// A POSIX shared-memory object of `bytes` bytes, unlinked at the end.
class ShmObject {
 public:
  ShmObject(const std::string& name, size_t bytes) : name_(name) {
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << name_ << ": " << std::strerror(errno);
    if (fd >= 0) {
      EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
      close(fd);
    }
  }
  ~ShmObject() { shm_unlink(name_.c_str()); }
  const std::string& name() const { return name_; }
  /// Writes a registration's challenge where it asks (the proof of write access).
  void Prove(const RegionChallenge& c) const {
    const int fd = shm_open(name_.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0) << name_ << ": " << std::strerror(errno);
    EXPECT_EQ(pwrite(fd, c.challenge.data(), c.challenge.size(), c.proof_offset),
              static_cast<ssize_t>(c.challenge.size()));
    close(fd);
  }

 private:
  std::string name_;
};

TEST(ClientRegionsConcurrency, SessionsRegisterFindHoldAndUnregisterAtOnce) {
  ClientRegions::Options o;
  o.max_regions = kThreads * 2;
  o.idle_timeout = std::chrono::milliseconds(40);  // the reaper runs all the time
  std::atomic<int64_t> regions_now{0}, bytes_now{0};
  o.on_change = [&](int64_t regions, int64_t bytes) {
    regions_now = regions;
    bytes_now = bytes;
  };
  ClientRegions regions(o);
  std::vector<std::unique_ptr<ShmObject>> objects;
  for (int t = 0; t < kThreads; ++t)
    objects.push_back(std::make_unique<ShmObject>(absl::StrCat("/pools-test-", getpid(), "-", t), 4096 + kProofBytes));
  OnThreads([&](int t) {
    const std::string owner = absl::StrCat("session-", t % 2);  // two threads per session
    const std::string name = absl::StrCat("r", t);
    for (int i = 0; i < kRounds / 4; ++i) {
      auto hold = regions.Hold(owner);  // in flight: the reaper leaves the session alone
      auto challenge = regions.Register(owner, name, objects[t]->name(), 4096);
      ASSERT_TRUE(challenge.ok()) << challenge.status();
      EXPECT_EQ(regions.Find(owner, name).status().code(), absl::StatusCode::kPermissionDenied) << "unconfirmed";
      objects[t]->Prove(*challenge);
      ASSERT_TRUE(regions.Confirm(owner, name).ok());
      auto found = regions.Find(owner, name);
      ASSERT_TRUE(found.ok()) << found.status();
      EXPECT_EQ((*found)->shm_name(), objects[t]->name());
      EXPECT_FALSE(regions.Find(absl::StrCat("other-", owner), name).ok()) << "sessions must not see each other";
      EXPECT_GE(regions.List(owner).size(), 1u);
      auto gone = regions.Unregister(owner, name);
      ASSERT_TRUE(gone.ok()) << gone.status();
      EXPECT_EQ(*gone, 1);
    }
  });
  EXPECT_EQ(regions_now.load(), 0);
  EXPECT_EQ(bytes_now.load(), 0);
  for (int s = 0; s < 2; ++s) EXPECT_TRUE(regions.List(absl::StrCat("session-", s)).empty());
}

}  // namespace
}  // namespace logprob
