// How a worker pool's processes come to exist: the one thing that differs
// between spawning local workers and waiting for workers started elsewhere.
// The generations, rank assignment and supervision are WorkerPool's.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"

namespace logprob {

/// Starts, watches and stops the processes of one pool generation at a
/// time. Called from one thread at a time (WorkerPool's start-up and
/// supervisor).
class WorkerLauncher {
 public:
  virtual ~WorkerLauncher() = default;
  /// Brings up the processes of generation `generation`, which join the
  /// control plane at `frontend` (host:port).
  virtual absl::Status Launch(int64_t generation, const std::string& frontend) = 0;
  /// A description of a worker process known to have exited (e.g. "worker
  /// pid 12 was killed by signal 9"), or nullopt.
  virtual std::optional<std::string> Poll() = 0;
  /// Stops the processes of the current generation (a failed one, or at
  /// shutdown); the workers' Join streams end afterwards.
  virtual void Stop() = 0;
  /// True when workers arrive on their own: the pool waits for them with no
  /// time limit (the join time-out then counts from the last join).
  virtual bool waits_for_workers() const = 0;
  /// True when the workers run on this host (they can read the front-end's
  /// POSIX shared memory, so payloads need not go through gRPC).
  virtual bool same_host() const = 0;
  /// Words for logs: "spawns 2 local workers".
  virtual std::string Describe() const = 0;
};

}  // namespace logprob
