// Backpressure: a bound on the work the front-end has accepted and not yet
// answered, by tokens and by request bytes.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace logprob {

/// Counts admitted work; a request that would push either total over its
/// limit is refused with RESOURCE_EXHAUSTED instead of queueing without
/// bound. Thread-safe.
class Admission {
 public:
  /// Called with the new (requests, tokens, bytes) in flight after every
  /// admit, resize and release, under the lock so calls arrive in order
  /// (metrics gauges).
  using Observer = std::function<void(int64_t requests, int64_t tokens, int64_t bytes)>;

  Admission(int64_t max_tokens, int64_t max_bytes, Observer observer = {})
      : max_tokens_(max_tokens), max_bytes_(max_bytes), observer_(std::move(observer)) {}

  /// Holds one request's share until destroyed (empty when
  /// default-constructed or moved from: holds nothing).
  class Ticket {
   public:
    Ticket() : owner_(nullptr), tokens_(0), bytes_(0) {}
    Ticket(Ticket&& o) noexcept : owner_(o.owner_), tokens_(o.tokens_), bytes_(o.bytes_) { o.owner_ = nullptr; }
    Ticket& operator=(Ticket&& o) noexcept;
    Ticket(const Ticket&) = delete;
    ~Ticket();
    bool empty() const { return owner_ == nullptr; }
    int64_t bytes() const { return owner_ ? bytes_ : 0; }

   private:
    friend class Admission;
    Ticket(Admission* owner, int64_t tokens, int64_t bytes) : owner_(owner), tokens_(tokens), bytes_(bytes) {}
    Admission* owner_;
    int64_t tokens_, bytes_;
  };

  /// Admits `tokens` token rows and `bytes` request bytes, or returns
  /// RESOURCE_EXHAUSTED with the current load and the limits (the client
  /// should retry with backoff). A request alone over a limit is admitted
  /// when nothing else is in flight (per-request limits are separate).
  absl::StatusOr<Ticket> Admit(int64_t tokens, int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  /// Sets what `*ticket` holds to `tokens` and `bytes`: Admit's rule for
  /// what it adds (an empty ticket is admitted as a new request; one alone
  /// in flight may grow over a limit), never refused for what it gives
  /// back. A request's bytes reserved before its body was read (the
  /// announced or largest size) become its actual size, then its share.
  /// RESOURCE_EXHAUSTED as Admit's, the ticket unchanged.
  absl::Status Resize(Ticket* ticket, int64_t tokens, int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  /// Resize, waiting up to `deadline` for room when it does not fit now
  /// (released or shrunk tickets make room): a request whose size is not
  /// known before its body arrives reserves the largest one for the read
  /// only, and the next such request waits for that read instead of being
  /// refused. RESOURCE_EXHAUSTED as Resize's once `deadline` passes.
  absl::Status ResizeWaiting(Ticket* ticket, int64_t tokens, int64_t bytes, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  int64_t tokens() const ABSL_LOCKS_EXCLUDED(mu_);  // admitted, not yet released
  int64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t requests() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int64_t max_tokens_, max_bytes_;
  const Observer observer_;
  mutable absl::Mutex mu_;
  absl::CondVar room_;  // signalled when a ticket gives back
  int64_t tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t requests_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Status Refusal(int64_t tokens, int64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Whether `held` (null: a new request) may hold `tokens` and `bytes`.
  bool FitsLocked(const Ticket* held, int64_t tokens, int64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace logprob
