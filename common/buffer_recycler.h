// Large buffers kept for reuse across lm_head versions (issue 34): the
// buffer a released version held becomes the next version's, so an update
// neither allocates nor first-touches fresh memory (a CUDA worker's
// cudaMalloc of ~600 MB per version; host memory's page faults).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace logprob {

/// Buffers of one allocator, handed out by exact size and taken back when
/// their holder lets them go: a returned buffer is kept idle (at most
/// `max_idle` of each size; the rest are freed) and the next Take of that
/// size gets it instead of a new allocation. Idle buffers are freed when
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
        if (s->Keep(p, bytes_)) return;
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
    if (void* p = state_->TakeIdle(bytes)) return Buffer(p, Return(state_, bytes));
    void* p = nullptr;
    if (absl::Status st = Alloc::Allocate(&p, bytes); !st.ok()) return st;
    {
      absl::MutexLock lock(&state_->mu);
      ++state_->allocated;
    }
    return Buffer(p, Return(state_, bytes));
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
    /// An idle buffer of `bytes`, or null.
    void* TakeIdle(size_t bytes) {
      absl::MutexLock lock(&mu);
      auto it = idle.find(bytes);
      if (it == idle.end()) return nullptr;
      void* p = it->second;
      idle.erase(it);
      ++reused;
      return p;
    }
    /// True when `p` is kept idle (under the cap of its size).
    bool Keep(void* p, size_t bytes) {
      absl::MutexLock lock(&mu);
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
    size_t allocated ABSL_GUARDED_BY(mu) = 0;
    size_t reused ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<State> state_;
};

}  // namespace logprob
