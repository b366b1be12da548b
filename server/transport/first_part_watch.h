// Streams that have not sent their first message yet (PutLmHeadRows): each
// holds a server thread while it waits, so their number is capped and
// each waits at most a timeout, after which its call is cancelled.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"

namespace logprob {

/// Watches calls waiting for their first message. Thread-safe.
class FirstPartWatch {
 public:
  /// At most `max_waiting` calls wait at once; one that waits `timeout` is
  /// cancelled (ServerContext::TryCancel: its Read returns false).
  FirstPartWatch(int max_waiting, std::chrono::milliseconds timeout);
  /// Stops the watcher's thread (the calls it watched must be over).
  ~FirstPartWatch();
  FirstPartWatch(const FirstPartWatch&) = delete;
  FirstPartWatch& operator=(const FirstPartWatch&) = delete;

  /// One call's wait, from Watch until destroyed (its first message read,
  /// or the call over).
  class Waiting {
   public:
    Waiting(Waiting&& o) noexcept : owner_(o.owner_), key_(o.key_) { o.owner_ = nullptr; }
    Waiting(const Waiting&) = delete;
    ~Waiting();

   private:
    friend class FirstPartWatch;
    Waiting(FirstPartWatch* owner, int64_t key) : owner_(owner), key_(key) {}
    FirstPartWatch* owner_;
    int64_t key_;
  };

  /// Starts watching `context` (which outlives the Waiting), or
  /// RESOURCE_EXHAUSTED "METHOD: N calls are waiting for their first
  /// message ..." when max_waiting already wait.
  absl::StatusOr<Waiting> Watch(grpc::ServerContext* context, const char* method) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    grpc::ServerContext* context;
    Clock::time_point deadline;
  };
  void Loop();

  const int max_waiting_;
  const std::chrono::milliseconds timeout_;
  absl::Mutex mu_;
  absl::CondVar changed_;                                  // a call waits, or stop
  std::map<int64_t, Entry> waiting_ ABSL_GUARDED_BY(mu_);  // context null once cancelled
  int64_t next_key_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace logprob
