#include "tests/in_process_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace logprob::testing {

InProcessGroup::InProcessGroup(int size, std::chrono::milliseconds timeout)
    : size_(size), timeout_(timeout), slots_(size) {}

void InProcessGroup::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = true;
  cv_.notify_all();
}

absl::Status InProcessGroup::Arrive() {
  std::unique_lock<std::mutex> lock(mu_);
  if (aborted_) return absl::UnavailableError("in-process group aborted: a rank failed");
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++phase_;
    cv_.notify_all();
    return absl::OkStatus();
  }
  const uint64_t mine = phase_;
  if (!cv_.wait_for(lock, timeout_, [&] { return phase_ != mine || aborted_; })) {
    aborted_ = true;  // the group is unusable afterwards, as after a Gloo time-out
    cv_.notify_all();
    return absl::DeadlineExceededError(
        absl::StrCat("in-process collective: ", size_ - arrived_, " rank(s) did not arrive in time"));
  }
  if (phase_ == mine) return absl::UnavailableError("in-process group aborted: a rank failed");
  return absl::OkStatus();
}

absl::Status InProcessCommunicator::AllGather(const void* in, size_t bytes, void* out) {
  auto& slot = group_.slots_[rank_];
  slot.in = static_cast<const char*>(in);
  slot.send_bytes.assign(1, static_cast<int64_t>(bytes));
  if (auto st = group_.Arrive(); !st.ok()) return st;
  absl::Status mismatch;
  for (int q = 0; q < size(); ++q) {
    const auto& from = group_.slots_[q];
    if (from.send_bytes.size() != 1 || from.send_bytes[0] != static_cast<int64_t>(bytes)) {
      mismatch = absl::InvalidArgumentError(
          absl::StrCat("all-gather: rank ", q, " contributes other than ", bytes, " bytes (rank ", rank_, ")"));
      continue;
    }
    if (bytes) std::memcpy(static_cast<char*>(out) + q * bytes, from.in, bytes);
  }
  if (auto st = group_.Arrive(); !st.ok()) return st;  // every rank has copied: inputs may go
  ++collectives_;
  return mismatch;
}

absl::Status InProcessCommunicator::AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                              const std::vector<int64_t>& recv_bytes) {
  const int W = size();
  if (static_cast<int>(send_bytes.size()) != W || static_cast<int>(recv_bytes.size()) != W) {
    group_.Abort();  // the peers would wait for this rank's contribution forever
    return absl::InvalidArgumentError("all-to-all: send_bytes and recv_bytes need one entry per rank");
  }
  auto& slot = group_.slots_[rank_];
  slot.in = static_cast<const char*>(in);
  slot.send_bytes = send_bytes;
  if (auto st = group_.Arrive(); !st.ok()) return st;
  absl::Status mismatch;
  int64_t at = 0;
  for (int q = 0; q < W; ++q) {
    const auto& from = group_.slots_[q];
    int64_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += from.send_bytes[r];
    if (from.send_bytes[rank_] != recv_bytes[q]) {
      mismatch = absl::InvalidArgumentError(absl::StrCat("all-to-all: rank ", q, " sends ", from.send_bytes[rank_],
                                                         " bytes to rank ", rank_, ", which expects ", recv_bytes[q]));
    } else if (recv_bytes[q] > 0) {
      std::memcpy(static_cast<char*>(out) + at, from.in + offset, static_cast<size_t>(recv_bytes[q]));
    }
    at += recv_bytes[q];
  }
  if (auto st = group_.Arrive(); !st.ok()) return st;
  ++collectives_;
  return mismatch;
}

}  // namespace logprob::testing
