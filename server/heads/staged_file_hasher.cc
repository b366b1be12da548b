#include "server/heads/staged_file_hasher.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/positioned_io.h"

namespace logprob {
namespace {

constexpr int64_t kReadBytes = int64_t{4} << 20;

}  // namespace

StagedFileHasher::StagedFileHasher(int fd, uint64_t data_offset, int64_t total, bool background)
    : fd_(fcntl(fd, F_DUPFD_CLOEXEC, 0)),
      data_offset_(data_offset),
      total_(total),
      background_(background),
      digest_(promise_.get_future().share()),
      started_(!background),
      thread_([this] { Loop(); }) {}

StagedFileHasher::~StagedFileHasher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  thread_.join();
  if (fd_ >= 0) close(fd_);
}

void StagedFileHasher::Start() {
  absl::MutexLock lock(&mu_);
  started_ = true;
  cv_.SignalAll();
}

void StagedFileHasher::Written(int64_t begin, int64_t end) {
  if (end <= begin) return;
  absl::MutexLock lock(&mu_);
  pending_[begin] = end;
  cv_.SignalAll();
}

void StagedFileHasher::Loop() {
  // Linux: the nice value of this thread only.
  if (background_) (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  // No larger than the file: a small head's update does not pay for
  // zeroing and faulting in 4 MiB.
  std::vector<char> buf(static_cast<size_t>(std::min(kReadBytes, std::max<int64_t>(total_, 1))));
  Hash(buf);
  absl::MutexLock lock(&mu_);
  promise_.set_value(hex_);  // "" when it failed or was stopped
}

void StagedFileHasher::Hash(std::vector<char>& buf) {
  for (;;) {
    int64_t from = 0, to = 0;
    {
      absl::MutexLock lock(&mu_);
      // Wait for written bytes right after the hashed prefix. (A CondVar,
      // not Mutex::Await: the TSan build sees CondVar waits release mu_,
      // common/tsan_absl_mutex.cc.)
      while (!(stop_ || failed_ || hashed_ == total_ ||
               (started_ && !pending_.empty() && pending_.begin()->first == hashed_)))
        cv_.Wait(&mu_);
      if (hashed_ == total_ && !failed_) {
        hex_ = sha_.FinishHex();
        cv_.SignalAll();  // Finish waits for hex_
      }
      if (stop_ || failed_ || hashed_ == total_) return;
      from = hashed_;
      to = std::min(pending_.begin()->second, from + kReadBytes);
    }
    const size_t n = static_cast<size_t>(to - from);
    const bool ok = PreadAll(fd_, buf.data(), n, data_offset_ + static_cast<uint64_t>(from));
    if (ok) sha_.Update(std::string_view(buf.data(), n));
    absl::MutexLock lock(&mu_);
    cv_.SignalAll();  // Finish waits for hashed_ or failed_
    if (!ok) {
      failed_ = true;
      return;
    }
    hashed_ = to;
    auto first = pending_.begin();
    if (first->second == to) {
      pending_.erase(first);
    } else {
      const int64_t end = first->second;
      pending_.erase(first);
      pending_[to] = end;
    }
  }
}

absl::StatusOr<std::string> StagedFileHasher::Finish() {
  absl::MutexLock lock(&mu_);
  while (!failed_ && hex_.empty()) cv_.Wait(&mu_);
  if (failed_)
    return absl::InternalError(absl::StrCat("reading the staged lm_head back for its sha256 failed at byte ",
                                            data_offset_ + static_cast<uint64_t>(hashed_)));
  return hex_;
}

}  // namespace logprob
