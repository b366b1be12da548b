// A worker's sums of the lm_head's weight and bias gradients over the
// micro-batches of optimizer steps (issue 47 item 2): a [V, H] float32
// gradient is 0.6 GB for Qwen3-0.6B's head, so it is accumulated where the
// head lives, one vocabulary slice per worker, and fetched once per step.
//
// A step is named by the client (its key, e.g. "run-7/step-12") and bound
// at its first backward to a head, a head version and the slice's shape;
// every later backward of the step must be for the same ones (the data
// parallel ranks of one step share its key, so the sum covers them all).
// The client fetches the sums in row pieces, then closes the step; a closed
// key is remembered (the last kClosedKeys) and a backward or fetch naming
// it again is refused, so that a retried or duplicated call cannot add a
// micro-batch twice into the next step's sums. Steps count against a byte
// budget (part of the worker's memory bound) and are dropped when idle for
// longer than a timeout.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace logprob {

/// The sums of one step on one worker's slice: dL/dW [rows, H] and dL/db
/// [rows] (empty without a bias), float32, row-major.
struct HeadGradientSums {
  std::string head, version;
  int64_t rows = 0, hidden_size = 0;
  std::vector<float> weight;  // [rows, H]
  std::vector<float> bias;    // [rows] or empty
  bool has_bias = false;      // the head has a bias (bias may be empty in a Read of no rows)
  int64_t micro_batches = 0;  // backwards added
  int64_t tokens = 0;         // their rows
  int64_t bytes() const { return static_cast<int64_t>((weight.size() + bias.size()) * sizeof(float)); }
};

/// The steps a worker accumulates. Thread-safe: backwards of one step run
/// one at a time (Accumulate holds the step while it adds), steps apart
/// concurrently.
class HeadGradientSteps {
 public:
  /// The last closed keys remembered (reuse refused).
  static constexpr size_t kClosedKeys = 4096;

  struct Options {
    int64_t max_bytes = 0;                            // budget over all open steps; > 0
    absl::Duration idle_timeout = absl::Minutes(10);  // an open step unused this long is dropped
  };
  explicit HeadGradientSteps(Options options) : options_(options) {}

  /// Adds one backward's gradients to `step`: `add(sums)` is called with
  /// the step's sums (zeroed at the step's first backward) while the step
  /// is held, and adds dL/dW / dL/db of `tokens` rows into them. The step
  /// is opened by its first call, for `head` / `version` and a slice of
  /// `rows` x `hidden_size` (with a bias when `bias`). Errors, nothing
  /// added: INVALID_ARGUMENT for an empty key or a shape that is not the
  /// step's; FAILED_PRECONDITION for another head or version than the
  /// step's; ALREADY_EXISTS for a closed key (reused); FAILED_PRECONDITION
  /// for a dropped one (its sums are lost); RESOURCE_EXHAUSTED when
  /// opening it would take the open steps over max_bytes (close or let
  /// expire other steps). `add`'s own error is returned, and the step's
  /// sums are then unspecified: the step is dropped, unless `add` marked
  /// its error NothingAdded (it failed before touching the sums: the step
  /// stays as it was). `now`: the clock (tests pass their own).
  absl::Status Accumulate(const std::string& step, const std::string& head, const std::string& version, int64_t rows,
                          int64_t hidden_size, bool bias, int64_t tokens,
                          const std::function<absl::Status(HeadGradientSums&)>& add, absl::Time now = absl::Now());

  /// A copy of rows [row_begin, row_end) of `step`'s sums: `weight`
  /// [row_end - row_begin, H] and `bias` (those rows; empty without a
  /// bias), the other fields the step's (rows: the slice's). NOT_FOUND for a key never
  /// opened, ALREADY_EXISTS for a closed key, FAILED_PRECONDITION for a
  /// dropped one (expired or failed: the message says which),
  /// OUT_OF_RANGE for rows outside the slice.
  absl::StatusOr<HeadGradientSums> Read(const std::string& step, int64_t row_begin, int64_t row_end,
                                        absl::Time now = absl::Now());

  /// `error`, marked for Accumulate as an error of an `add` that added
  /// nothing (the step is kept).
  static absl::Status NothingAdded(absl::Status error);

  /// Frees `step`'s sums and remembers its key as closed. Always OK:
  /// closing a closed or dropped key (a retried close) or a key never
  /// opened here (a worker that refused the step's only backward, while
  /// the others opened it) remembers it as closed all the same, so the key
  /// is never used afterwards. INVALID_ARGUMENT for an empty key.
  absl::Status Close(const std::string& step);

  /// Drops the steps idle longer than the timeout at `now`; returns how
  /// many. Accumulate and Read sweep too.
  int Sweep(absl::Time now = absl::Now());

  int64_t bytes() const;  // held by open steps
  size_t open_steps() const;

 private:
  struct Step {
    absl::Mutex mu;  // held while a backward adds or a read copies
    HeadGradientSums sums ABSL_GUARDED_BY(mu);
    int64_t bytes = 0;     // fixed at opening
    absl::Time last_used;  // guarded by HeadGradientSteps::mu_
    /// The sums, their [rows, H] weight part allocated (zeros) at first
    /// use: under this step's lock, not HeadGradientSteps::mu_.
    HeadGradientSums& Zeroed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (sums.weight.empty()) sums.weight.assign(static_cast<size_t>(sums.rows * sums.hidden_size), 0.0f);
      return sums;
    }
  };
  int SweepLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Removes an open step and remembers why its key ended.
  void EndLocked(const std::string& step, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The error for a key that ended (closed: ALREADY_EXISTS, dropped:
  /// FAILED_PRECONDITION), or OK when it did not.
  absl::Status EndedLocked(const std::string& step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Step>> steps_ ABSL_GUARDED_BY(mu_);
  // Keys that ended (closed, expired, failed) -> why; the last kClosedKeys.
  std::map<std::string, std::string> ended_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace logprob
