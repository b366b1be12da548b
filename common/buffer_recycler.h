// Large buffers kept for reuse across lm_head versions (issue 34): the
// buffer a released version held becomes the next version's, so an update
// neither allocates nor first-touches fresh memory (a CUDA worker's
// cudaMalloc of ~600 MB per version; host memory's page faults).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace logprob {

/// Buffers of one allocator, handed out by exact size and taken back when
/// their holder lets them go: a returned buffer is kept idle (at most
/// `max_idle` of each size; the rest are freed) and the next Take of that
/// size gets it instead of a new allocation. Only sizes still in use are
/// kept (issue 50: after a vocabulary or precision change the old size
/// would otherwise stay idle for good): a returned buffer is kept while
/// another buffer of its size is held or its size is the latest Take's;
/// a Take of a new size frees the idle buffers of every size no buffer is
/// held of; TrimIdle frees them on demand. Idle buffers are freed when
/// the recycler goes; buffers still held when it goes are freed by their
/// holders. `Alloc` has static `absl::Status Allocate(void** p, size_t
/// bytes)` and `void Free(void* p)` (called without the recycler's lock,
/// on the thread that returns a buffer beyond the idle cap or drops the
/// recycler: the CUDA allocators expect their device current there).
/// Thread-safe.
template <typename Alloc>
class BufferRecycler {
  struct State;

 public:
  /// Returns its buffer to the recycler it came from (or frees it when the
  /// recycler is gone).
  class Return {
   public:
    Return() = default;
    Return(std::weak_ptr<State> state, size_t bytes) : state_(std::move(state)), bytes_(bytes) {}
    void operator()(void* p) const {
      if (auto s = state_.lock()) {
        std::vector<void*> unused;
        const bool kept = s->Keep(p, bytes_, &unused);
        for (void* q : unused) Alloc::Free(q);
        if (kept) return;
      }
      Alloc::Free(p);
    }

   private:
    std::weak_ptr<State> state_;
    size_t bytes_ = 0;
  };
  /// A buffer of Take's size; going back to the recycler when reset or destroyed.
  using Buffer = std::unique_ptr<void, Return>;

  /// Keeps at most `max_idle` idle buffers of each size (0: none kept,
  /// every Take allocates).
  explicit BufferRecycler(size_t max_idle = 1) : state_(std::make_shared<State>(max_idle)) {}
  BufferRecycler(const BufferRecycler&) = delete;
  BufferRecycler& operator=(const BufferRecycler&) = delete;
  ~BufferRecycler() = default;

  /// A buffer of exactly `bytes` (> 0): an idle one of that size when
  /// there is one (its contents are what its last holder left), else a new
  /// one. Errors: INVALID_ARGUMENT for 0 bytes; Alloc::Allocate's error.
  absl::StatusOr<Buffer> Take(size_t bytes) {
    if (bytes == 0) return absl::InvalidArgumentError("BufferRecycler::Take: 0 bytes");
    // Idle buffers of sizes nobody holds make room first (a new size is
    // the likeliest to need it).
    TrimIdle(bytes);
    if (void* p = state_->TakeIdle(bytes)) return Buffer(p, Return(state_, bytes));
    void* p = nullptr;
    if (absl::Status st = Alloc::Allocate(&p, bytes); !st.ok()) return st;
    {
      absl::MutexLock lock(&state_->mu);
      ++state_->allocated;
      ++state_->held[bytes];
    }
    return Buffer(p, Return(state_, bytes));
  }

  /// Frees the idle buffers of every size but `keep_bytes` that no held
  /// buffer has (0: every such size), and makes `keep_bytes` the size a
  /// returned buffer is kept for even when none other is held (the next
  /// Take's, e.g. a staging buffer between versions). For a holder that
  /// knows the old sizes are done with (a converting load that needs no
  /// staging: TrimIdle(0)).
  void TrimIdle(size_t keep_bytes) {
    std::vector<void*> unused;
    {
      absl::MutexLock lock(&state_->mu);
      state_->latest = keep_bytes;
      for (auto it = state_->idle.begin(); it != state_->idle.end();) {
        if (it->first != keep_bytes && state_->held.count(it->first) == 0) {
          unused.push_back(it->second);
          it = state_->idle.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (void* p : unused) Alloc::Free(p);
  }

  /// Buffers allocated by Take so far (reused ones not counted).
  size_t allocated() const {
    absl::MutexLock lock(&state_->mu);
    return state_->allocated;
  }
  /// Takes answered with an idle buffer so far.
  size_t reused() const {
    absl::MutexLock lock(&state_->mu);
    return state_->reused;
  }
  /// Bytes of the idle buffers kept now.
  size_t idle_bytes() const {
    absl::MutexLock lock(&state_->mu);
    size_t bytes = 0;
    for (const auto& [size, p] : state_->idle) bytes += size;
    return bytes;
  }

 private:
  struct State {
    explicit State(size_t max_idle) : max_idle(max_idle) {}
    /// An idle buffer of `bytes` (then counted as held), or null.
    void* TakeIdle(size_t bytes) {
      absl::MutexLock lock(&mu);
      auto it = idle.find(bytes);
      if (it == idle.end()) return nullptr;
      void* p = it->second;
      idle.erase(it);
      ++reused;
      ++held[bytes];
      return p;
    }
    /// True when `p` (returned by its holder) is kept idle: under the cap
    /// of its size, and its size still in use (another buffer of it held,
    /// or the latest Take's). When its size is no longer in use, the idle
    /// buffers of that size go to *unused (for the caller to free).
    bool Keep(void* p, size_t bytes, std::vector<void*>* unused) {
      absl::MutexLock lock(&mu);
      auto h = held.find(bytes);
      if (h != held.end() && --h->second == 0) held.erase(h);
      const bool in_use = held.count(bytes) > 0 || bytes == latest;
      if (!in_use) {
        for (auto [it, end] = idle.equal_range(bytes); it != end;) {
          unused->push_back(it->second);
          it = idle.erase(it);
        }
        return false;
      }
      if (idle.count(bytes) >= max_idle) return false;
      idle.emplace(bytes, p);
      return true;
    }
    ~State() {
      for (const auto& [size, p] : idle) Alloc::Free(p);
    }
    const size_t max_idle;
    mutable absl::Mutex mu;
    std::multimap<size_t, void*> idle ABSL_GUARDED_BY(mu);
    std::map<size_t, size_t> held ABSL_GUARDED_BY(mu);  // buffers out with holders, by size
    size_t latest ABSL_GUARDED_BY(mu) = 0;              // the latest Take's size (TrimIdle's keep_bytes)
    size_t allocated ABSL_GUARDED_BY(mu) = 0;
    size_t reused ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<State> state_;
};

}  // namespace logprob
