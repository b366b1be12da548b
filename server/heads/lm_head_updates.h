// Staged, all-or-nothing updates of named lm_heads (refit): the update
// protocol, free of any transport. An update is opened for a head and a
// new version (Begin), filled with rows (Put: inline bytes, bytes that
// follow the message, a memory reference or a checkpoint file), and
// committed (every worker loads the new version while scoring goes on;
// then it becomes current) or aborted. The rows are written into a
// safetensors file of the store (server/heads/lm_head_store.h), which workers
// read their slices from, so re-formed workers load committed versions
// from it. The gRPC handlers (server/transport/scoring_service.cc) only translate;
// any other caller (a test, another transport, a peer's catch-up) drives
// Begin / Put / Commit / Abort the same way.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "logprob/internal/v1/worker.pb.h"
#include "logprob/v1/logprob.pb.h"
#include "server/heads/lm_head_store.h"
#include "server/heads/lm_heads.h"
#include "server/heads/staged_file_hasher.h"
#include "server/heads/version_releases.h"
#include "server/inputs/input_resolver.h"
#include "server/inputs/input_source.h"

namespace logprob {

/// The most a file put reads into memory of each file it names (a
/// safetensors header, an index or config.json): a client's file is
/// refused beyond it (INVALID_ARGUMENT) instead of costing up to the
/// format's 100 MiB per put. Real checkpoints' headers are kilobytes to a
/// few MiB.
inline constexpr uint64_t kMaxUpdateFileMetadataBytes = uint64_t{16} << 20;

/// What logs and errors print for update `id`: the first 8 hex digits of
/// SHA-256(id), never the id (the capability to put, commit and abort; a
/// log reader must not be able to use it). The holder can compute it.
std::string UpdateTag(const std::string& id);

/// What an update's workers do: load a version on every worker of the
/// current pool generation (returning that generation's index, or the
/// first worker error), tell whether that generation is still the one
/// serving, drop a version on every worker (best effort), and stage rows
/// the front-end cannot read itself.
struct LmHeadWorkers {
  std::function<absl::StatusOr<int64_t>(const internal::v1::LmHeadLoad&)> load;
  std::function<bool(int64_t generation)> serving;
  /// True when every worker let it go (its file may then be rewritten).
  std::function<bool(const internal::v1::LmHeadRef&)> drop;
  /// Has one worker on the front-end's host copy the bytes of a source
  /// the front-end cannot read (InputKindRules::readable_here false: a
  /// same-host client's CUDA IPC allocation) into the staged file
  /// (Worker.StageLmHeadRows): OK only when every byte was written. Called
  /// concurrently for disjoint ranges. Empty when no worker can (sources
  /// of such kinds are then refused with the kind's `unavailable` reason).
  std::function<absl::Status(const internal::v1::LmHeadStage&)> stage;
};

/// Outcome counters and timings of updates, for metrics. May be empty.
struct LmHeadUpdateObservers {
  /// An update ended: head, "committed" or the abort reason's class
  /// ("aborted", "timeout", "worker_error", "sha256_mismatch", "rows_missing", "non_finite"),
  /// seconds from Begin to the end, bytes received.
  std::function<void(const std::string& head, const std::string& outcome, double seconds, int64_t bytes)> on_end;
  /// Rows' bytes received (PutRows).
  std::function<void(const std::string& head, int64_t bytes)> on_bytes;
  /// The store's bytes (LmHeadStore::Bytes), every time the update thread
  /// wakes (about 5 times a second).
  std::function<void(int64_t bytes)> on_store_bytes;
};

/// How a put's row bytes reach the core where LmHeadRows.rows does not
/// hold them inline: given by the transport (all members may be empty).
struct LmHeadPutIo {
  /// Bytes that follow the message (gRPC: TensorPiece parts), called when
  /// rows.data holds fewer bytes than the shape announces: writes the
  /// rows' n * H * sizeof(dtype) bytes (rows.data's first) to `dst` (their
  /// place in the staged file: no buffer, no second copy), calling
  /// `progressed(written)` as bytes arrive, with `written` the length of
  /// dst's prefix that holds its bytes by then (the update's time-out
  /// counts from the last progress; that prefix is scanned for NaN and
  /// infinity while in cache); OK when every byte was written. Empty: the
  /// inline bytes must be all of them.
  std::function<absl::Status(char* dst, const std::function<void(int64_t written)>& progressed)> follow;
  /// The caller, for a reference to memory (LmHeadRows.rows with
  /// shared_memory or cuda_ipc), which Options::inputs resolves (checks of
  /// the caller's rights included).
  InputCaller caller;
  /// Ends the transport's call (gRPC: TryCancel) when the update ends
  /// while this put waits for bytes (a time-out), so a stalled sender
  /// cannot hold a handler thread. May be called from another thread,
  /// once, while Put runs.
  std::function<void()> cancel;
};

/// The open updates of a server's heads. Thread-safe.
class LmHeadUpdates {
 public:
  struct Options {
    bool allowed = false;    // --allow-lm-head-updates
    std::string store_dir;   // where staged and committed versions are written
    std::string update_dir;  // --lm-head-update-dir: file sources are confined to it; empty: none allowed
    // An open update without progress this long (no Begin, put, row block
    // or piece arriving) is aborted, also while a put waits for bytes
    // (its call is ended: LmHeadPutIo::cancel).
    std::chrono::milliseconds timeout{300000};
    int64_t memory_bytes = 0;  // per worker, every held version plus the staged one; 0: no cap
    /// The most store files one head may have: its versions alive in the
    /// store (retained, or released and still pinned by requests in
    /// flight), its staged update and its spares. --lm-head-retain + 3,
    /// what the memory bound counts (server/app/memory_bound.h
    /// LmHeadStoreBytes); 0: no cap.
    int store_files_per_head = 0;
    /// Resolves rows given as a memory reference (the app's resolver, the
    /// scoring core's too; not owned, outlives this). Null: such rows are
    /// refused (INVALID_ARGUMENT).
    InputResolver* inputs = nullptr;
  };

  /// `heads` and the callbacks outlive this; `releases` is the queue
  /// `heads` pushes released versions to. Starts the time-out and release
  /// thread.
  LmHeadUpdates(Options options, LmHeads* heads, std::shared_ptr<LmHeadReleases> releases, LmHeadWorkers workers,
                LmHeadUpdateObservers observers = {});
  /// Aborts the open updates (their files are removed).
  ~LmHeadUpdates();

  /// Opens an update (BeginLmHeadUpdateRequest). Errors: FAILED_PRECONDITION
  /// (reason LM_HEAD_UPDATES_DISABLED) when updates are off; NOT_FOUND for
  /// an unknown head; FAILED_PRECONDITION naming --lm-head-frozen for a
  /// frozen head; INVALID_ARGUMENT for a bad version name, a shape or
  /// dtype other than the head's, a malformed sha256, a logit_scale,
  /// final_logit_softcapping or bias that is not valid (named);
  /// FAILED_PRECONDITION when the head has an open update (naming its
  /// version and age, never its id: the id is the capability to put,
  /// commit and abort), unless the request repeats that update's version,
  /// sha256 and client_token (a retried Begin: the open update is the
  /// answer), or repeats its version and (non-empty) sha256 with another
  /// client_token (several ranks pushing the same weight): then it waits
  /// until that update ends, up to `deadline` (DEADLINE_EXCEEDED after),
  /// and answers already_committed when it was committed, or opens its
  /// own update when it was aborted; INVALID_ARGUMENT for a malformed client_token; ALREADY_EXISTS
  /// when the version is held with another (or no given) sha256;
  /// RESOURCE_EXHAUSTED over memory_bytes, or when a new store file would
  /// take the head over store_files_per_head (released versions still
  /// pinned by requests in flight: retry once they are answered); INTERNAL when the store file
  /// cannot be made. A version held with the same sha256 gives
  /// already_committed and opens nothing.
  /// The new version's transform is the head's, with the request's
  /// logit_scale, final_logit_softcapping and bias where given. A bias it
  /// has from the request, or from another version's store file, is
  /// written to a file of its own beside its weight
  /// (`<stem>.bias.safetensors`, removed on abort and when the version is
  /// released); one from the head's start-up checkpoint is read there.
  absl::StatusOr<v1::LmHeadUpdate> Begin(const v1::BeginLmHeadUpdateRequest& req,
                                         absl::Time deadline = absl::InfiniteFuture()) ABSL_LOCKS_EXCLUDED(mu_);

  /// The one entry point of a put (PutLmHeadRows): rows [row_begin,
  /// row_begin + n) of update `put.update_id` from `put.rows` ([n, H] of the
  /// update's dtype: bytes inline in rows.data, bytes that follow through
  /// `io.follow`, or a memory reference through `io.resolve`), or every row
  /// from `put.file` (row_begin 0; PutFile's rules). INVALID_ARGUMENT naming
  /// the field for neither source, a shape other than [n > 0, H > 0], a
  /// dtype not F32 / BF16 / F16, inline bytes of the wrong size, a
  /// reference without `io.resolve`; then PutRows' and PutFile's errors.
  absl::StatusOr<v1::LmHeadUpdate> Put(const v1::LmHeadRows& put, const LmHeadPutIo& io = {}) ABSL_LOCKS_EXCLUDED(mu_);

  /// Put's rows from a source already resolved: writes rows [row_begin, row_begin + rows) of update `id` from `source`
  /// (rows * H * sizeof(dtype) bytes, row-major; `dtype` and `columns` as
  /// the sender announced them, which must be the update's dtype and H). Every row must come
  /// exactly once over all calls (concurrent calls of disjoint ranges are
  /// fine); a retry of exactly a range received whole with the same bytes
  /// answers OK (compared with the staged bytes; a CUDA IPC retry cannot
  /// be and is INVALID_ARGUMENT), with other bytes INVALID_ARGUMENT. NOT_FOUND for an unknown, ended or aborted update
  /// (with why); INVALID_ARGUMENT for a range outside [0, V), rows already given (or being given), a source of the
  /// wrong size; DATA_LOSS when the source cannot be read. A source the front-end cannot read (a CUDA IPC reference,
  /// InputSource::Refer) is copied into the staged file by a worker (LmHeadWorkers::stage), then counts like any other:
  /// FAILED_PRECONDITION with the kind's unavailable reason
  /// (CUDA_IPC_UNAVAILABLE) when there is no stage callback, and the
  /// worker's error (the reason added to a FAILED_PRECONDITION: the worker
  /// cannot open the handle) when staging fails; the rows are then not
  /// counted and may be sent again.
  absl::StatusOr<v1::LmHeadUpdate> PutRows(const std::string& id, int64_t row_begin, int64_t rows, DType dtype,
                                           int64_t columns, const InputSource& source) ABSL_LOCKS_EXCLUDED(mu_);

  /// Checks every row arrived and the sha256, loads the version on every
  /// worker, and makes it current. Safe to retry: a Commit of an update
  /// that ended (among the last 256) answers its outcome (the head's info
  /// as committed, or the error that ended it: ABORTED for a client's
  /// abort or a time-out), never NOT_FOUND. On any failure the update is aborted
  /// (workers drop what they loaded) and the current version keeps
  /// serving. FAILED_PRECONDITION for rows missing (naming the first
  /// range) or when the pool changed while loading; INVALID_ARGUMENT for a
  /// sha256 mismatch (both named) or a NaN or infinite weight (the first
  /// one's row and column; scanned in the staged file's mapping while the
  /// workers load, outcome "non_finite"); UNAVAILABLE / the worker's error when a
  /// worker fails to load.
  absl::StatusOr<v1::LmHeadInfo> Commit(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);

  /// Aborts update `id` (its file is removed). NOT_FOUND when not open.
  absl::StatusOr<v1::LmHeadUpdate> Abort(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);

  /// The store's files (its bytes: LmHeadStore::Bytes).
  const LmHeadStore& store() const { return store_; }

  const Options& options() const { return options_; }

 private:
  struct Update;
  /// PutRows for a writer that fills the rows itself (LmHeadPutIo::follow):
  /// the same checks (no source: its size and kind are the caller's), then
  /// `write(dst, progressed)` with dst the rows' bytes in the staged file.
  /// Its error frees the range, as a failed source does.
  absl::StatusOr<v1::LmHeadUpdate> PutRowsWith(const std::string& id, int64_t row_begin, int64_t rows, DType dtype,
                                               int64_t columns, const LmHeadPutIo& io) ABSL_LOCKS_EXCLUDED(mu_);

  /// PutRows of every row of a safetensors checkpoint under update_dir
  /// (`path` relative to it, PATH and TENSOR of ResolveLmHead with
  /// `tensor`), opened and read as CheckpointRows::OpenBeneath says (its
  /// errors); the checkpoint's shape, dtype and transform must be the
  /// update's (INVALID_ARGUMENT). Errors name the path the client gave,
  /// never bytes read.
  absl::StatusOr<v1::LmHeadUpdate> PutFile(const std::string& id, const std::string& path, const std::string& tensor)
      ABSL_LOCKS_EXCLUDED(mu_);

  /// The open update `id` (NOT_FOUND with why otherwise). mu_ held.
  absl::StatusOr<std::shared_ptr<Update>> Open(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Open, taking mu_.
  absl::StatusOr<std::shared_ptr<Update>> Find(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  /// Ends `u` (aborted: why), removes its files, reports it; with
  /// `cancel_waiting`, first ends the calls of its puts waiting for bytes
  /// (RowIntake::Close). mu_ held. `u` by value: it erases open_'s copy
  /// (a caller may pass that one).
  void End(std::shared_ptr<Update> u, const std::string& outcome, const std::string& why, bool cancel_waiting = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The time-out and release thread.
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  LmHeads* const heads_;
  const LmHeadWorkers workers_;
  const LmHeadUpdateObservers observers_;
  const std::shared_ptr<LmHeadReleases> releases_;
  LmHeadStore store_;
  VersionReleases released_;  // releases_' versions: dropped, their files recycled

  absl::Mutex mu_;
  absl::CondVar cv_;
  std::map<std::string, std::shared_ptr<Update>> open_ ABSL_GUARDED_BY(mu_);  // by id
  std::map<std::string, std::string> ended_ ABSL_GUARDED_BY(mu_);             // id -> why (recent)
  /// How the last kOutcomesKept updates ended (a retried Commit answers it):
  /// OK with the committed head's info, or the abort's error.
  struct Outcome {
    absl::Status status;
    v1::LmHeadInfo info;
  };
  std::map<std::string, Outcome> outcomes_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> outcome_order_ ABSL_GUARDED_BY(mu_);  // ids, oldest first
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread loop_;
};

}  // namespace logprob
