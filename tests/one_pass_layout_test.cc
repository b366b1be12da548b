// The one-pass arithmetic (worker/scoring/one_pass_layout.h) on the CPU: row
// ranges, slots, all-gather offsets, all-to-all sizes and displacements and
// the [W][rows][words] record layout, for W = 1..8, n < W, n % W != 0 and
// several pass sizes. The collectives are simulated on host buffers filled
// with values that name their row and slice, and every value is checked
// where the CUDA backend would read it; the agreement runs on in-process
// ranks.
#include "worker/scoring/one_pass_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/fake_device_copy.h"
#include "tests/in_process_communicator.h"
#include "worker/comm/host_staged_device_collectives.h"

namespace logprob {
namespace {

/// The value record word `w` of vocabulary slice `slice` has for item row `row`.
uint32_t RecordWord(int slice, int64_t row, size_t w) {
  return static_cast<uint32_t>(slice * 1000003 + row * 131 + static_cast<int64_t>(w) + 1);
}

/// The value of hidden-state byte `b` of item row `row`.
char HiddenByte(int64_t row, size_t b) { return static_cast<char>((row * 7 + static_cast<int64_t>(b) * 3 + 1) % 251); }

std::vector<int64_t> Sizes(int W) {
  std::vector<int64_t> n = {0, 1, 37, 100};
  if (W > 1) n.push_back(W - 1);         // n < W: some ranks hold no rows
  n.push_back(2 * W + (W > 1 ? 1 : 0));  // n % W != 0 (W > 1)
  n.push_back(16 * W + 3);
  return n;
}

TEST(OnePassLayout, AlignRowsAndDisplacements) {
  EXPECT_EQ(AlignRows(0), 0);
  EXPECT_EQ(AlignRows(1), 16);
  EXPECT_EQ(AlignRows(16), 16);
  EXPECT_EQ(AlignRows(17), 32);
  EXPECT_EQ(Displacements({3, 0, 5, 2}), (std::vector<int64_t>{0, 3, 3, 8}));
  EXPECT_EQ(Displacements({}), std::vector<int64_t>{});
  EXPECT_EQ(AllGatherOffset(3, 40), 120u);
  EXPECT_EQ(RecordIndex(2, 5, 7, 10), static_cast<size_t>((2 * 7 + 5) * 10));
}

TEST(OnePassLayout, SplitRowsTilesTheItemLargerSharesFirst) {
  for (int W = 1; W <= 8; ++W) {
    for (int64_t n : Sizes(W)) {
      SCOPED_TRACE(::testing::Message() << "W = " << W << ", n = " << n);
      const RankRows r = SplitRows(n, W);
      ASSERT_EQ(r.size(), W);
      EXPECT_TRUE(CheckRankRows(r, W, n).ok());
      EXPECT_EQ(r.total(), n);
      EXPECT_EQ(r.most(), (n + W - 1) / W);
      for (int q = 0; q < W; ++q) {
        EXPECT_EQ(r.count[q], n / W + (q < n % W ? 1 : 0)) << "rank " << q;
        if (q > 0) {
          EXPECT_EQ(r.first[q], r.first[q - 1] + r.count[q - 1]) << "rank " << q;
        }
      }
    }
  }
}

TEST(OnePassLayout, CheckRankRowsRejectsRangesThatDoNotTile) {
  RankRows r = SplitRows(10, 3);
  EXPECT_FALSE(CheckRankRows(r, 2, 10).ok());
  EXPECT_FALSE(CheckRankRows(r, 3, 11).ok());
  r.first[1] += 1;
  EXPECT_FALSE(CheckRankRows(r, 3, 10).ok());
  RankRows negative = SplitRows(10, 3);
  negative.count[2] = -1;
  EXPECT_FALSE(CheckRankRows(negative, 3, 10).ok());
}

TEST(OnePassLayout, PassRowsForBudgetIsAlignedAndFits) {
  EXPECT_EQ(PassRowsForBudget(0, 4, 8192), kSlotAlignRows);
  EXPECT_EQ(PassRowsForBudget(size_t{1} << 30, 8, 8192), 16384);  // 2^30 / (8 * 8192)
  for (int W = 1; W <= 8; ++W) {
    const int64_t p = PassRowsForBudget(size_t{100} << 20, W, 5000);
    EXPECT_EQ(p % kSlotAlignRows, 0) << W;
    EXPECT_LE(static_cast<size_t>(p) * W * 5000, size_t{100} << 20) << W;
    EXPECT_GT(static_cast<size_t>(p + kSlotAlignRows) * W * 5000, size_t{100} << 20) << W;
  }
}

// Every rank's view of every pass: each item row appears once, in its own
// rank's slot; the all-gather (simulated) puts each rank's rows where the
// GEMM reads them; the all-to-all (simulated with the layout's sizes and
// displacements) and the scatter with RecordIndex give every rank the
// records of its own rows from every slice, [W][rows][words].
TEST(OnePassLayout, PassesGatherAndExchangeEveryRowOnce) {
  const size_t words = 5, row_bytes = 6;
  for (int W = 1; W <= 8; ++W) {
    for (int64_t n : Sizes(W)) {
      for (int64_t pass_rows : {1, 3, 16, 1000}) {
        SCOPED_TRACE(::testing::Message() << "W = " << W << ", n = " << n << ", pass_rows = " << pass_rows);
        const RankRows rows = SplitRows(n, W);
        const OnePassLayout layout(rows, pass_rows);
        EXPECT_EQ(layout.passes(), (rows.most() + pass_rows - 1) / pass_rows);
        std::vector<int> seen(n, 0);
        // own[me]: the records rank `me` ends with, [W][count[me]][words].
        std::vector<std::vector<uint32_t>> own(W);
        for (int me = 0; me < W; ++me) own[me].assign(RecordIndex(W, 0, rows.count[me], words), 0);
        int64_t max_slot = 0, max_total = 0;
        for (int64_t p = 0; p < layout.passes(); ++p) {
          const PassLayout pass = layout.Pass(p);
          EXPECT_EQ(pass.pass_row0, p * pass_rows);
          EXPECT_EQ(pass.slot_rows % kSlotAlignRows, 0);
          EXPECT_GT(pass.total(), 0) << "pass " << p << " is empty";
          max_slot = std::max(max_slot, pass.slot_rows);
          max_total = std::max(max_total, pass.total());
          // All-gather: every rank fills its slot; rank q's rows are at SlotOffset(q).
          std::vector<char> gathered(W * pass.SlotBytes(row_bytes), 0);
          for (int q = 0; q < W; ++q) {
            EXPECT_LE(pass.count[q], pass_rows);
            EXPECT_LE(pass.count[q], pass.slot_rows);
            EXPECT_EQ(pass.item_first[q], rows.first[q] + pass.pass_row0);
            if (q > 0) {
              EXPECT_EQ(pass.record_row[q], pass.record_row[q - 1] + pass.count[q - 1]);
            }
            for (int64_t i = 0; i < pass.count[q]; ++i) {
              const int64_t row = pass.item_first[q] + i;
              ASSERT_LT(row, rows.first[q] + rows.count[q]);
              ++seen[row];
              for (size_t b = 0; b < row_bytes; ++b)
                gathered[AllGatherOffset(q, pass.SlotBytes(row_bytes)) + i * row_bytes + b] = HiddenByte(row, b);
            }
          }
          for (int q = 0; q < W; ++q)
            for (int64_t i = 0; i < pass.count[q]; ++i)
              for (size_t b = 0; b < row_bytes; ++b)
                ASSERT_EQ(gathered[pass.SlotOffset(q, row_bytes) + i * row_bytes + b],
                          HiddenByte(pass.item_first[q] + i, b));
          // Each rank's packed records of the pass (its slice `r`), rank order.
          std::vector<std::vector<uint32_t>> sent(W);
          for (int r = 0; r < W; ++r) {
            sent[r].assign(pass.total() * words, 0);
            for (int q = 0; q < W; ++q)
              for (int64_t i = 0; i < pass.count[q]; ++i)
                for (size_t w = 0; w < words; ++w)
                  sent[r][(pass.record_row[q] + i) * words + w] = RecordWord(r, pass.item_first[q] + i, w);
          }
          // The all-to-all as a transport does it, from the sizes alone.
          std::vector<std::vector<int64_t>> send(W), recv(W);
          for (int r = 0; r < W; ++r) pass.RecordExchange(r, words, &send[r], &recv[r]);
          for (int me = 0; me < W; ++me) {
            const std::vector<int64_t> recv_off = Displacements(recv[me]);
            std::vector<char> received(recv_off.empty() ? 0 : recv_off.back() + recv[me].back());
            for (int r = 0; r < W; ++r) {
              ASSERT_EQ(send[r][me], recv[me][r]) << "rank " << r << " -> " << me;
              const std::vector<int64_t> send_off = Displacements(send[r]);
              if (send[r][me] > 0)  // an empty buffer's data() may be null
                std::memcpy(received.data() + recv_off[r], reinterpret_cast<const char*>(sent[r].data()) + send_off[me],
                            static_cast<size_t>(send[r][me]));
            }
            // The received buffer is [W][count[me]][words]; scatter into own.
            const uint32_t* rec = reinterpret_cast<const uint32_t*>(received.data());
            for (int q = 0; q < W; ++q)
              for (int64_t i = 0; i < pass.count[me]; ++i)
                for (size_t w = 0; w < words; ++w)
                  own[me][RecordIndex(q, pass.pass_row0 + i, rows.count[me], words) + w] =
                      rec[RecordIndex(q, i, pass.count[me], words) + w];
          }
        }
        EXPECT_EQ(layout.max_slot_rows(), max_slot);
        EXPECT_EQ(layout.max_total_rows(), max_total);
        for (int64_t row = 0; row < n; ++row) EXPECT_EQ(seen[row], 1) << "row " << row;
        for (int me = 0; me < W; ++me)
          for (int q = 0; q < W; ++q)
            for (int64_t i = 0; i < rows.count[me]; ++i)
              for (size_t w = 0; w < words; ++w)
                ASSERT_EQ(own[me][RecordIndex(q, i, rows.count[me], words) + w], RecordWord(q, rows.first[me] + i, w))
                    << "rank " << me << ", slice " << q << ", row " << i << ", word " << w;
      }
    }
  }
}

/// Runs AgreeOnPass on W in-process ranks with these votes and proposals.
std::vector<absl::StatusOr<int64_t>> Agree(const std::vector<PassVote>& votes, const std::vector<int64_t>& proposals) {
  const int W = static_cast<int>(votes.size());
  testing::InProcessGroup group(W);
  std::vector<absl::StatusOr<int64_t>> out(W, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      testing::InProcessCommunicator comm(group, r);
      const absl::Status failure =
          votes[r] == PassVote::kFailed ? absl::InternalError("CUDA cudaMalloc: out of memory") : absl::OkStatus();
      out[r] = AgreeOnPass(comm, votes[r], proposals[r], failure);
    });
  for (auto& t : threads) t.join();
  return out;
}

TEST(OnePassLayout, AgreeOnPassTakesTheSmallestProposalWhenAllGo) {
  const auto out = Agree({PassVote::kGo, PassVote::kGo, PassVote::kGo}, {64, 32, 48});
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(out[r].ok()) << out[r].status();
    EXPECT_EQ(*out[r], 32) << "rank " << r;
  }
}

TEST(OnePassLayout, AgreeOnPassStopsEveryRankWhenOneFailsOrIsCancelled) {
  {
    const auto out =
        Agree({PassVote::kGo, PassVote::kFailed, PassVote::kCancelled, PassVote::kFailed}, {16, 16, 16, 16});
    EXPECT_EQ(out[1].status().code(), absl::StatusCode::kInternal);  // its own failure
    EXPECT_EQ(out[3].status().code(), absl::StatusCode::kInternal);
    for (int r : {0, 2}) {
      EXPECT_EQ(out[r].status().code(), absl::StatusCode::kResourceExhausted) << r;
      EXPECT_NE(std::string(out[r].status().message()).find("rank 1 "), std::string::npos) << out[r].status();
    }
  }
  {
    const auto out = Agree({PassVote::kGo, PassVote::kCancelled}, {16, 16});
    for (int r = 0; r < 2; ++r) EXPECT_EQ(out[r].status().code(), absl::StatusCode::kCancelled) << r;
  }
  {
    const auto out = Agree({PassVote::kGo}, {48});
    ASSERT_TRUE(out[0].ok());
    EXPECT_EQ(*out[0], 48);
  }
}

/// A rank's copy stream as the one-pass path uses it (issue 35 item 3):
/// an upload is accepted when queued and runs later, at Wait, where its
/// execution error (a CUDA IPC copy fault, a staging copy) first shows,
/// as cudaMemcpyAsync and cudaEventSynchronize behave. "Device memory" is
/// host memory. One per rank's thread.
class FakeUploadStream {
 public:
  /// Queues a copy of `bytes` from `src` to `dst`; `faults`: it fails
  /// when it runs. Accepted (OK) like every asynchronous copy.
  absl::Status Queue(char* dst, const char* src, size_t bytes, bool faults) {
    queued_.push_back({dst, src, bytes, faults});
    return absl::OkStatus();
  }
  /// Runs what was queued; the first fault's error (the rest still runs).
  absl::Status Wait() {
    absl::Status st;
    for (const Copy& c : queued_) {
      ++waited;
      if (c.faults) {
        if (st.ok()) st = absl::InternalError("CUDA device work: injected upload fault");
        continue;
      }
      std::memcpy(c.dst, c.src, c.bytes);
    }
    queued_.clear();
    return st;
  }
  int waited = 0;  // copies run

 private:
  struct Copy {
    char* dst;
    const char* src;
    size_t bytes;
    bool faults;
  };
  std::vector<Copy> queued_;
};

/// What one rank of a pass's first steps ended with.
struct PassStart {
  absl::Status status = absl::UnknownError("not run");
  bool gathered = false;     // entered the device all-gather
  int64_t collectives = -1;  // host collectives the rank completed
  std::string slots;         // its gathered slots afterwards
};

/// W ranks (threads) each upload `slot` bytes into their slot, agree, and
/// all-gather the slots (HostStagedDeviceCollectives over in-process
/// ranks, as CUDA workers over Gloo): RunPass's steps 1 and 2. Rank
/// `faulty`'s upload fails when it runs; rank `stopping` must stop.
/// `vote_first`: the order before issue 35 (vote on the queuing, wait
/// after it). `timeout`: how long a rank waits in a collective.
std::vector<PassStart> StartPass(int W, int faulty, int stopping, bool vote_first, std::chrono::milliseconds timeout) {
  constexpr size_t slot = 64;
  testing::InProcessGroup group(W, timeout);
  std::vector<PassStart> out(W);
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r)
    threads.emplace_back([&, r] {
      auto inner = std::make_unique<testing::InProcessCommunicator>(group, r);
      const testing::InProcessCommunicator* host = inner.get();
      HostStagedDeviceCollectives comm(std::move(inner), std::make_unique<testing::FakeDeviceCopy>());
      const std::string rows(slot, static_cast<char>('a' + r));
      std::string slots(W * slot, '.');
      FakeUploadStream stream;
      const bool stop = r == stopping;
      const absl::Status queued =
          stop ? absl::OkStatus() : stream.Queue(slots.data() + r * slot, rows.data(), slot, r == faulty);
      absl::Status st;
      if (vote_first) {
        st = AgreeOnPass(comm,
                         !queued.ok() ? PassVote::kFailed
                         : stop       ? PassVote::kCancelled
                                      : PassVote::kGo,
                         16, queued)
                 .status();
        if (st.ok()) st = stream.Wait();
      } else {
        st = AgreeAfterUploads(comm, stop, 16, queued, [&] { return stream.Wait(); });
      }
      if (st.ok()) {
        out[r].gathered = true;
        st = comm.AllGatherDevice(slots.data() + r * slot, slot, slots.data());
      }
      out[r].status = st;
      out[r].collectives = host->collectives();
      out[r].slots = slots;
    });
  for (auto& t : threads) t.join();
  return out;
}

TEST(OnePassLayout, AgreeAfterUploadsLetsEveryRankGatherWhenAllUploadsRan) {
  const auto out = StartPass(3, /*faulty=*/-1, /*stopping=*/-1, /*vote_first=*/false, std::chrono::seconds(60));
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    ASSERT_TRUE(out[r].status.ok()) << out[r].status;
    EXPECT_TRUE(out[r].gathered);
    EXPECT_EQ(out[r].collectives, 4);  // the vote and the staged all-gather's three
    EXPECT_EQ(out[r].slots, std::string(64, 'a') + std::string(64, 'b') + std::string(64, 'c'));
  }
}

TEST(OnePassLayout, AnUploadFailingWhileItRunsStopsEveryRankBeforeTheAllGather) {
  // Rank 1's upload is accepted and fails when it runs. With the vote after
  // the uploads ran, every rank learns it in the vote: none enters the
  // all-gather, so none waits there for the collective timeout (60 s
  // here: a peer left in it would end DEADLINE_EXCEEDED, not as below).
  const auto out = StartPass(3, /*faulty=*/1, /*stopping=*/-1, /*vote_first=*/false, std::chrono::seconds(60));
  EXPECT_EQ(out[1].status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(out[1].status.message(), "CUDA device work: injected upload fault");
  for (int r : {0, 2}) {
    SCOPED_TRACE(r);
    EXPECT_EQ(out[r].status.code(), absl::StatusCode::kResourceExhausted) << out[r].status;
    EXPECT_NE(std::string(out[r].status.message()).find("rank 1 "), std::string::npos) << out[r].status;
  }
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    EXPECT_FALSE(out[r].gathered);
    EXPECT_EQ(out[r].collectives, 1);  // the vote only
  }
}

TEST(OnePassLayout, VotingBeforeTheUploadsRanLeavesPeersInTheAllGather) {
  // The order before issue 35, for contrast: every rank votes kGo on its
  // queued upload; rank 1 then finds its fault and returns, and its peers
  // wait in the all-gather until the (here short) collective timeout.
  const auto out = StartPass(3, /*faulty=*/1, /*stopping=*/-1, /*vote_first=*/true, std::chrono::milliseconds(500));
  EXPECT_EQ(out[1].status.code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(out[1].gathered);
  // The first peer to time out aborts the group (the others then end
  // UNAVAILABLE).
  int timed_out = 0;
  for (int r : {0, 2}) {
    SCOPED_TRACE(r);
    EXPECT_TRUE(out[r].gathered);
    const absl::StatusCode code = out[r].status.code();
    EXPECT_TRUE(code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kUnavailable) << out[r].status;
    timed_out += code == absl::StatusCode::kDeadlineExceeded;
  }
  EXPECT_GE(timed_out, 1);
}

TEST(OnePassLayout, AgreeAfterUploadsCancelsEveryRankWhenOneMustStop) {
  const auto out = StartPass(2, /*faulty=*/-1, /*stopping=*/1, /*vote_first=*/false, std::chrono::seconds(60));
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(out[r].status.code(), absl::StatusCode::kCancelled) << out[r].status;
    EXPECT_FALSE(out[r].gathered);
  }
  // A failed queuing is voted on without waiting.
  testing::InProcessGroup group(1);
  testing::InProcessCommunicator comm(group, 0);
  bool waited = false;
  const absl::Status st =
      AgreeAfterUploads(comm, false, 16, absl::InternalError("CUDA hidden states upload: queued"), [&] {
        waited = true;
        return absl::OkStatus();
      });
  EXPECT_EQ(st.message(), "CUDA hidden states upload: queued");
  EXPECT_FALSE(waited);
}

}  // namespace
}  // namespace logprob
