#include "common/standby_mappings.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace logprob {

void StandbyMappings::Release(Entry e) {
  if (e.addr != nullptr) munmap(e.addr, e.length);
  if (e.fd >= 0) close(e.fd);
}

void StandbyMappings::State::Put(Entry e) {
  std::vector<Entry> out;  // unmapped outside the lock
  {
    absl::MutexLock lock(&mu);
    if (stop || capacity == 0) {
      out.push_back(e);
    } else {
      entries.push_front(e);
      while (entries.size() > capacity) {
        out.push_back(entries.back());
        entries.pop_back();
      }
    }
  }
  for (Entry& x : out) Release(x);
}

size_t StandbyMappings::State::Sweep() {
  std::vector<Entry> out;
  size_t left = 0;
  {
    absl::MutexLock lock(&mu);
    for (auto it = entries.begin(); it != entries.end();) {
      struct stat st {};
      if (fstat(it->fd, &st) != 0 || st.st_nlink == 0) {
        out.push_back(*it);
        it = entries.erase(it);
      } else {
        ++it;
      }
    }
    left = entries.size();
  }
  for (Entry& x : out) Release(x);
  return left;
}

StandbyMappings::StandbyMappings(size_t capacity) : state_(std::make_shared<State>()) {
  state_->capacity = capacity;
  sweeper_ = std::thread([s = state_] {
    for (;;) {
      {
        absl::MutexLock lock(&s->mu);
        if (!s->stop) s->stopped.WaitWithTimeout(&s->mu, absl::Seconds(1));
        if (s->stop) return;
      }
      s->Sweep();
    }
  });
}

StandbyMappings::~StandbyMappings() {
  std::list<Entry> out;
  {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;  // mappings returned from now on are unmapped
    state_->stopped.SignalAll();
    out.swap(state_->entries);
  }
  sweeper_.join();
  for (Entry& x : out) Release(x);
}

std::shared_ptr<void> StandbyMappings::Map(int fd, const struct stat& st, uint64_t begin, size_t length) {
  // First the mappings of removed files go: tmpfs may give a removed file's
  // inode number to a new one, and `fd`'s file (open, so named or held)
  // can then only match a standby mapping of itself.
  state_->Sweep();
  Entry e;
  {
    absl::MutexLock lock(&state_->mu);
    for (auto it = state_->entries.begin(); it != state_->entries.end(); ++it) {
      if (it->dev == st.st_dev && it->ino == st.st_ino && it->begin == begin && it->length == length) {
        e = *it;
        state_->entries.erase(it);
        ++state_->reused;
        break;
      }
    }
  }
  if (e.addr == nullptr) {
    void* p = mmap(nullptr, length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, static_cast<off_t>(begin));
    if (p == MAP_FAILED) return nullptr;
    const int kept = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (kept < 0)  // no descriptor to watch the file with: not kept
      return std::shared_ptr<void>(p, [length](void* q) { munmap(q, length); });
    e = Entry{st.st_dev, st.st_ino, begin, length, p, kept};
  }
  return std::shared_ptr<void>(e.addr, [e, weak = std::weak_ptr<State>(state_)](void*) {
    if (const std::shared_ptr<State> s = weak.lock()) {
      s->Put(e);
    } else {
      Release(e);
    }
  });
}

size_t StandbyMappings::Sweep() { return state_->Sweep(); }

size_t StandbyMappings::standby() const {
  absl::MutexLock lock(&state_->mu);
  return state_->entries.size();
}

uint64_t StandbyMappings::reused() const {
  absl::MutexLock lock(&state_->mu);
  return state_->reused;
}

}  // namespace logprob
