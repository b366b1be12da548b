// A Communicator (worker/comm/communicator.h) for W ranks that are threads of
// one process: collectives copy through shared memory between two
// barriers. Lets unit tests run the worker's scorer (ScoreWorkItem) on W
// threads, every layout, without processes, sockets or Gloo.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "worker/comm/communicator.h"

namespace logprob::testing {

/// The shared state of a group of `size` in-process ranks: a reusable
/// barrier and, per rank, the buffer it contributes to the collective in
/// progress. Thread-safe; outlives its communicators.
class InProcessGroup {
 public:
  /// `timeout` bounds each barrier wait: a rank that never arrives (a bug
  /// in the code under test) gives DEADLINE_EXCEEDED instead of a hang.
  explicit InProcessGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60));

  int size() const { return size_; }
  /// Makes every pending and later collective of the group fail with
  /// UNAVAILABLE (a rank failed before its collectives: the others must
  /// not wait for it), as a Gloo group does when a peer goes away.
  void Abort();

 private:
  friend class InProcessCommunicator;
  /// What one rank contributes to the collective in progress.
  struct Contribution {
    const char* in = nullptr;
    std::vector<int64_t> send_bytes;  // AllToAllV: bytes for each peer, consecutive in `in`
  };
  /// Waits until all ranks have arrived (one phase of a collective).
  /// UNAVAILABLE once aborted, DEADLINE_EXCEEDED after the timeout.
  absl::Status Arrive();

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t phase_ = 0;  // completed barrier phases
  bool aborted_ = false;
  std::vector<Contribution> slots_;  // one per rank
};

/// Rank `rank` of an InProcessGroup. Each collective is two barrier
/// phases: all ranks publish their input, copy what they need from the
/// others' inputs, then wait until every rank has copied (so inputs stay
/// valid). AllToAllV checks that the sizes agree (INVALID_ARGUMENT, on the
/// receiving rank). One thread per rank; the group must outlive it.
class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup& group, int rank) : group_(group), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  absl::Status AllGather(const void* in, size_t bytes, void* out) override;
  absl::Status AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                         const std::vector<int64_t>& recv_bytes) override;
  /// Collectives this rank has completed (tests count rounds with it).
  int64_t collectives() const { return collectives_; }

 private:
  InProcessGroup& group_;
  const int rank_;
  int64_t collectives_ = 0;
};

}  // namespace logprob::testing
