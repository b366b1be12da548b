// Waiting on a non-blocking NCCL communicator with a deadline (issue 50):
// ncclCommInitRankConfig with blocking = 0 returns at once and the
// communicator's asynchronous error says ncclInProgress until it is ready,
// so a peer that never joins cannot hang a worker's start-up; the caller
// aborts the communicator (ncclCommAbort) when the deadline passes. Header
// only (nccl.h's types; no NCCL call), so it is tested on the CPU with a
// fake (tests/cuda_error_test.cc).
#pragma once

#include <nccl.h>

#include <chrono>
#include <thread>

namespace logprob::cuda {

/// Polls `async_error()` (e.g. ncclCommGetAsyncError of the communicator)
/// until it answers something other than ncclInProgress, and returns that
/// (ncclSuccess: ready); returns ncclInProgress when `deadline` passed
/// first (the caller aborts). Checked at least once; `pause` between polls.
/// `Clock` is std::chrono::steady_clock unless a test's.
template <typename Clock = std::chrono::steady_clock, typename AsyncError>
ncclResult_t PollNccl(AsyncError&& async_error, typename Clock::time_point deadline,
                      std::chrono::microseconds pause = std::chrono::microseconds(50)) {
  for (;;) {
    const ncclResult_t r = async_error();
    if (r != ncclInProgress) return r;
    if (Clock::now() >= deadline) return ncclInProgress;
    if (pause.count() > 0) std::this_thread::sleep_for(pause);
  }
}

}  // namespace logprob::cuda
