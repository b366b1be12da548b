// One driver of the lm_head update protocol (proto/logprob/v1/logprob.proto
// "lm_head updates"; docs/lm-head-updates.md): Begin with a client_token,
// the rows in puts, Commit, Abort on failure, with the protocol's retries.
// logprob-client's `update-lm-head` drives a server over gRPC
// (common/lm_head_update_grpc.h); a front-end catching up with its peers
// drives its own update core in-process (server/transport/lm_head_peer_sync.cc).
// The Python client's `update_lm_head` follows the same steps
// (client/python/logprob_client/_internal/lm_head_sender.py).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob {

/// Bytes of rows one put carries at most (the Python client's
/// UPDATE_PUT_BYTES): each put ends with a round trip, so fewer puts move
/// a head faster (docs/benchmarks.md); neither side holds a put's bytes
/// beyond one buffer. Also bounded by 90% of the server's max_request_bytes.
inline constexpr int64_t kDefaultUpdatePutBytes = int64_t{256} << 20;

/// Where an update's rows come from.
struct LmHeadRowSource {
  /// Writes rows [row_begin, row_end) (row-major, the update's dtype) to
  /// `dst`, which holds (row_end - row_begin) rows, calling `progressed`
  /// with the bytes written so far whenever some arrived (a stream's
  /// pieces). Errors end the update (it is aborted).
  std::function<absl::Status(int64_t row_begin, int64_t row_end, char* dst,
                             const std::function<void(int64_t bytes)>& progressed)>
      read;
  /// A put that failed can be read and sent again (a file: true; a stream
  /// read once: false).
  bool rereadable = true;
  /// Ends a `read` in progress from another thread (the update timed out),
  /// which then fails. May be empty.
  std::function<void()> cancel;
};

/// The protocol's four calls, however they reach a server: gRPC
/// (GrpcLmHeadUpdateCalls) or an update core in the same process
/// (server/heads/lm_head_update_calls.h).
/// Statuses are the server's (as absl::Status).
class LmHeadUpdateCalls {
 public:
  virtual ~LmHeadUpdateCalls() = default;
  virtual absl::StatusOr<v1::LmHeadUpdate> Begin(const v1::BeginLmHeadUpdateRequest& request) = 0;
  /// Rows [row_begin, row_end) of update `update_id`, their bytes read from
  /// `rows` (straight into their destination where the calls can).
  virtual absl::StatusOr<v1::LmHeadUpdate> Put(const std::string& update_id, const v1::BeginLmHeadUpdateRequest& begin,
                                               int64_t row_begin, int64_t row_end, const LmHeadRowSource& rows) = 0;
  virtual absl::StatusOr<v1::LmHeadInfo> Commit(const std::string& update_id) = 0;
  virtual absl::Status Abort(const std::string& update_id) = 0;
};

/// How DriveLmHeadUpdate sends.
struct LmHeadUpdateDriverOptions {
  /// Rows per put; 0: as many as fit in put_bytes (at least one).
  int64_t rows_per_put = 0;
  int64_t put_bytes = kDefaultUpdatePutBytes;
  /// Tries of each call that UNAVAILABLE ended (Begin: the same
  /// client_token answers the update it opened; a put that failed counted
  /// no rows, and one that landed answers OK when sent again; Commit
  /// answers the first one's outcome). Puts of a source that cannot be read
  /// again are tried once. 1: no retry.
  int attempts = 3;
  std::chrono::milliseconds backoff{200};  // before the 2nd try, doubled for each further one
  /// Called after each put with the server's count of rows received. May be empty.
  std::function<void(const v1::LmHeadUpdate& progress)> on_put;
};

/// What an update ended with.
struct LmHeadUpdateOutcome {
  /// The server held this (head, version, sha256) already: nothing was sent.
  bool already_committed = false;
  v1::LmHeadInfo committed;  // the committed version (unset when already_committed)
};

/// Drives one update: Begin `begin` (a random client_token is set when it
/// has none), puts rows [0, vocab_size) from `rows` in order, Commit. On
/// any error after Begin the update is aborted (its error kept) and the
/// old version keeps serving. Errors are the calls' (or the source's),
/// their message prefixed with the step ("BeginLmHeadUpdate: ",
/// "PutLmHeadRows rows [A, B): ", "CommitLmHeadUpdate: "). Blocking
/// (sleeps between retries); thread-compatible (one update per call).
absl::StatusOr<LmHeadUpdateOutcome> DriveLmHeadUpdate(LmHeadUpdateCalls& calls, v1::BeginLmHeadUpdateRequest begin,
                                                      const LmHeadRowSource& rows,
                                                      const LmHeadUpdateDriverOptions& options = {});

}  // namespace logprob
