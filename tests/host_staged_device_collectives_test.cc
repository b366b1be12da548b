// Device collectives staged through host memory
// (worker/comm/host_staged_device_collectives.h), their host side on the CPU:
// W = 1..4 in-process ranks (tests/in_process_communicator.h), "device
// memory" in host memory (tests/fake_device_copy.h). The bytes every rank
// ends up with, what was copied each way, uneven and zero counts, in-place
// all-gathers, and failures on one rank that every rank hears of (no rank
// waits in a collective for a peer that left; the group stays usable).
#include "worker/comm/host_staged_device_collectives.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/fake_device_copy.h"
#include "tests/in_process_communicator.h"
#include "worker/scoring/one_pass_layout.h"

namespace logprob::testing {
namespace {

/// One rank's staged communicator and the parts the test looks at.
struct Rank {
  InProcessCommunicator* inner;  // owned by comm
  FakeDeviceCopy* copy;          // owned by comm
  std::unique_ptr<HostStagedDeviceCollectives> comm;
};

/// Runs body(rank) on W threads, one staged communicator per rank over one
/// in-process group (a rank stuck in a collective fails the test with
/// DEADLINE_EXCEEDED after 20 s instead of hanging). `setup` may arm the
/// fake copies before the threads start.
void OnRanks(int W, const std::function<void(Rank&)>& body,
             const std::function<void(int, FakeDeviceCopy&)>& setup = {}) {
  InProcessGroup group(W, std::chrono::seconds(20));
  std::vector<Rank> ranks(W);
  for (int r = 0; r < W; ++r) {
    auto inner = std::make_unique<InProcessCommunicator>(group, r);
    auto copy = std::make_unique<FakeDeviceCopy>();
    ranks[r].inner = inner.get();
    ranks[r].copy = copy.get();
    if (setup) setup(r, *copy);
    ranks[r].comm = std::make_unique<HostStagedDeviceCollectives>(std::move(inner), std::move(copy));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) threads.emplace_back([&, r] { body(ranks[r]); });
  for (auto& t : threads) t.join();
}

/// A byte that depends on the rank that produced it and its position.
char ByteOf(int rank, size_t i) { return static_cast<char>(rank * 37 + static_cast<int>(i % 251) + 1); }

TEST(HostStagedDeviceCollectives, ForwardsHostCollectivesAndSaysItHasDeviceOnes) {
  OnRanks(2, [](Rank& r) {
    EXPECT_TRUE(r.comm->device_collectives());
    EXPECT_EQ(r.comm->size(), 2);
    EXPECT_EQ(r.comm->rank(), r.inner->rank());
    const int32_t mine = 10 + r.comm->rank();
    int32_t all[2] = {0, 0};
    ASSERT_TRUE(r.comm->AllGather(&mine, sizeof mine, all).ok());
    EXPECT_EQ(all[0], 10);
    EXPECT_EQ(all[1], 11);
    EXPECT_TRUE(r.copy->calls.empty());  // host buffers: nothing staged
    EXPECT_EQ(r.inner->collectives(), 1);
  });
}

TEST(HostStagedDeviceCollectives, AllGatherDeviceMovesEveryRanksBytesThroughOneCopyEachWay) {
  for (int W = 1; W <= 4; ++W) {
    for (size_t bytes : {size_t{1}, size_t{7}, size_t{4096}}) {
      OnRanks(W, [&](Rank& r) {
        const int me = r.comm->rank();
        std::vector<char> in(bytes), out(W * bytes, 0);
        for (size_t i = 0; i < bytes; ++i) in[i] = ByteOf(me, i);
        ASSERT_TRUE(r.comm->AllGatherDevice(in.data(), bytes, out.data()).ok());
        for (int q = 0; q < W; ++q)
          for (size_t i = 0; i < bytes; ++i)
            ASSERT_EQ(out[AllGatherOffset(q, bytes) + i], ByteOf(q, i)) << "W " << W << " rank " << me << " from " << q;
        ASSERT_EQ(r.copy->calls.size(), 2u);
        EXPECT_FALSE(r.copy->calls[0].to_device);
        EXPECT_EQ(r.copy->calls[0].device, in.data());
        EXPECT_EQ(r.copy->calls[0].bytes, bytes);
        EXPECT_TRUE(r.copy->calls[1].to_device);
        EXPECT_EQ(r.copy->calls[1].device, out.data());
        EXPECT_EQ(r.copy->calls[1].bytes, W * bytes);
        // The collective and the two agreements around it.
        EXPECT_EQ(r.inner->collectives(), 3);
      });
    }
  }
}

TEST(HostStagedDeviceCollectives, InPlaceAllGatherDeviceKeepsEverySlot) {
  // The CUDA backend gathers its slots in place: in == out + offset(rank).
  for (int W = 1; W <= 4; ++W) {
    const size_t bytes = 48;
    OnRanks(W, [&](Rank& r) {
      const int me = r.comm->rank();
      std::vector<char> slots(W * bytes, 0);
      char* mine = slots.data() + AllGatherOffset(me, bytes);
      for (size_t i = 0; i < bytes; ++i) mine[i] = ByteOf(me, i);
      ASSERT_TRUE(r.comm->AllGatherDevice(mine, bytes, slots.data()).ok());
      for (int q = 0; q < W; ++q)
        for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(slots[AllGatherOffset(q, bytes) + i], ByteOf(q, i));
    });
  }
}

TEST(HostStagedDeviceCollectives, ZeroByteAllGatherDeviceMovesNothing) {
  OnRanks(3, [](Rank& r) {
    ASSERT_TRUE(r.comm->AllGatherDevice(nullptr, 0, nullptr).ok());
    EXPECT_TRUE(r.copy->calls.empty());
    EXPECT_EQ(r.inner->collectives(), 0);
  });
}

/// Bytes rank `from` sends rank `to` in the uneven all-to-all below
/// (zero for some pairs, and rank 1 sends nothing at all).
int64_t PairBytes(int from, int to) {
  if (from == 1) return 0;
  return (from * 5 + to * 3) % 4 == 0 ? 0 : 1 + (from * 7 + to * 13) % 29;
}

TEST(HostStagedDeviceCollectives, AllToAllVDeviceWithUnevenAndZeroCounts) {
  for (int W = 1; W <= 4; ++W) {
    OnRanks(W, [&](Rank& r) {
      const int me = r.comm->rank();
      std::vector<int64_t> send(W), recv(W);
      for (int q = 0; q < W; ++q) {
        send[q] = PairBytes(me, q);
        recv[q] = PairBytes(q, me);
      }
      const std::vector<int64_t> send_off = Displacements(send), recv_off = Displacements(recv);
      std::vector<char> in(send_off[W - 1] + send[W - 1]), out(recv_off[W - 1] + recv[W - 1] + 1, 0);
      // Byte i of the block for q: ByteOf(me * 8 + q, i).
      for (int q = 0; q < W; ++q)
        for (int64_t i = 0; i < send[q]; ++i) in[send_off[q] + i] = ByteOf(me * 8 + q, static_cast<size_t>(i));
      ASSERT_TRUE(r.comm->AllToAllVDevice(in.data(), send, out.data(), recv).ok()) << "W " << W << " rank " << me;
      for (int q = 0; q < W; ++q)
        for (int64_t i = 0; i < recv[q]; ++i)
          ASSERT_EQ(out[recv_off[q] + i], ByteOf(q * 8 + me, static_cast<size_t>(i)))
              << "W " << W << " rank " << me << " from " << q;
      EXPECT_EQ(out.back(), 0) << "wrote past the received bytes";
      // Copies only of bytes there are.
      const int64_t in_total = send_off[W - 1] + send[W - 1], out_total = recv_off[W - 1] + recv[W - 1];
      size_t copies = 0;
      for (const FakeDeviceCopy::Call& c : r.copy->calls) {
        EXPECT_GT(c.bytes, 0u);
        EXPECT_EQ(c.bytes, static_cast<size_t>(c.to_device ? out_total : in_total));
        ++copies;
      }
      EXPECT_EQ(copies, static_cast<size_t>((in_total > 0) + (out_total > 0)));
    });
  }
}

TEST(HostStagedDeviceCollectives, AFailedStagingOnOneRankFailsEveryRankBeforeTheCollective) {
  for (int W = 2; W <= 4; ++W) {
    for (int failing = 0; failing < W; ++failing) {
      OnRanks(
          W,
          [&](Rank& r) {
            const int me = r.comm->rank();
            std::vector<char> in(16, static_cast<char>(me)), out(W * 16, 0);
            const absl::Status st = r.comm->AllGatherDevice(in.data(), 16, out.data());
            if (me == failing) {
              EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
              EXPECT_NE(st.message().find("injected ToHost"), std::string::npos) << st;
            } else {
              EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
              EXPECT_NE(st.message().find("rank " + std::to_string(failing)), std::string::npos) << st;
            }
            // Nobody ran the collective or copied anything back.
            EXPECT_EQ(r.inner->collectives(), 1) << "only the agreement";
            EXPECT_EQ(out, std::vector<char>(W * 16, 0));
            // The group is still usable.
            r.copy->fail_to_host = false;
            int32_t mine = me, all[4] = {};
            ASSERT_TRUE(r.comm->AllGather(&mine, sizeof mine, all).ok());
            for (int q = 0; q < W; ++q) EXPECT_EQ(all[q], q);
          },
          [&](int r, FakeDeviceCopy& copy) { copy.fail_to_host = r == failing; });
    }
  }
}

TEST(HostStagedDeviceCollectives, AFailedCopyBackOnOneRankFailsEveryRank) {
  const int W = 3, failing = 2;
  OnRanks(
      W,
      [&](Rank& r) {
        const int me = r.comm->rank();
        std::vector<int64_t> sizes(W, 8);
        std::vector<char> in(W * 8, static_cast<char>(me)), out(W * 8, 0);
        const absl::Status st = r.comm->AllToAllVDevice(in.data(), sizes, out.data(), sizes);
        if (me == failing) {
          EXPECT_NE(st.message().find("injected ToDevice"), std::string::npos) << st;
        } else {
          EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
          EXPECT_NE(st.message().find("rank 2 could not copy the result"), std::string::npos) << st;
        }
        EXPECT_EQ(r.inner->collectives(), 3);
        r.copy->fail_to_device = false;
        ASSERT_TRUE(r.comm->AllToAllVDevice(in.data(), sizes, out.data(), sizes).ok());
        for (int q = 0; q < W; ++q) EXPECT_EQ(out[q * 8], static_cast<char>(q));
      },
      [&](int r, FakeDeviceCopy& copy) { copy.fail_to_device = r == failing; });
}

TEST(HostStagedDeviceCollectives, WrongSizesOnOneRankAreItsErrorAndNoPeerWaits) {
  const int W = 3;
  OnRanks(W, [&](Rank& r) {
    const int me = r.comm->rank();
    std::vector<int64_t> sizes(W, 4);
    if (me == 1) sizes.pop_back();
    std::vector<char> in(W * 4, 1), out(W * 4, 0);
    const absl::Status st = r.comm->AllToAllVDevice(in.data(), sizes, out.data(), sizes);
    if (me == 1) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    } else {
      EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
      EXPECT_NE(st.message().find("rank 1"), std::string::npos) << st;
    }
    EXPECT_TRUE(r.copy->calls.empty() || me != 1);
  });
}

}  // namespace
}  // namespace logprob::testing
