// The front-end's pool of worker processes: spawns them, serves their
// control plane, and runs planned work on them.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "server/control_service.h"
#include "server/planner.h"

namespace logprob {

/// A local pool of `workers` logprob-worker processes on this host.
class WorkerPool {
 public:
  struct Options {
    int workers = 1;
    std::string worker_binary;                 // path of logprob-worker
    std::string control_listen = "127.0.0.1:0";
    std::vector<std::string> worker_args;      // extra flags for each worker
    std::chrono::milliseconds join_timeout{60000};
    std::chrono::milliseconds work_timeout{600000};
    /// Sent to every worker in its JoinReply: lm_head source, hidden-states
    /// chunk, threads (rank, world size and store prefix are filled in).
    internal::v1::JoinReply worker_config;
  };

  explicit WorkerPool(Options options);
  ~WorkerPool();  // terminates the workers

  /// Starts the control plane, spawns the workers and waits until all are
  /// ready. UNAVAILABLE if a worker exits early, DEADLINE_EXCEEDED if they
  /// do not all join within join_timeout.
  absl::Status Start();

  int size() const { return options_.workers; }

  /// Runs every item of `plan` on its worker concurrently and returns the
  /// results in plan order. Vocab-parallel and hidden-states plans run one at a time (their
  /// collectives must not interleave). A failed worker call returns its
  /// status with the worker named.
  absl::StatusOr<std::vector<internal::v1::WorkResult>> Run(const Plan& plan);

 private:
  Options options_;
  std::unique_ptr<ControlService> control_;
  std::unique_ptr<grpc::Server> control_server_;
  std::vector<pid_t> pids_;
  std::vector<std::unique_ptr<internal::v1::Worker::Stub>> stubs_;
  std::mutex collective_mu_;
};

}  // namespace logprob
