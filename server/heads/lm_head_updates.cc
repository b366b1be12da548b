#include "server/heads/lm_head_updates.h"

#include <cstdlib>
#include <filesystem>
#include <future>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "common/lm_head_source.h"
#include "common/log_line.h"
#include "common/random_id.h"
#include "common/sha256.h"
#include "common/status_macros.h"
#include "server/heads/begin_checks.h"
#include "server/heads/row_intake.h"
#include "server/heads/staged_version.h"
#include "server/inputs/checkpoint_rows.h"

namespace logprob {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kEndedKept = 64;      // ended updates remembered for their error messages
constexpr size_t kOutcomesKept = 256;  // ended updates whose outcome a retried Commit gets

}  // namespace

std::string UpdateTag(const std::string& id) { return Sha256Hex(id).substr(0, 8); }

struct LmHeadUpdates::Update {
  std::string id, head, version, expected_sha256, client_token;
  LmHeadVersion next;       // what commits: source.file is the final path
  bool bias_given = false;  // BeginLmHeadUpdateRequest.bias was set
  // The version's files in the store: the staged file mapped read-write
  // (rows are copied in with memcpy), and its own bias file (written only
  // when the version's bias comes from the request or from another store
  // version). Made at Begin, renamed at Commit, removed on abort.
  std::unique_ptr<StagedVersion> staged;
  // The rows as they arrive: ranges given, bytes, progress (the time-out
  // counts from it), the first NaN or infinite element (each put scans its
  // rows as they land; Commit refuses the update by it).
  std::unique_ptr<RowIntake> intake;
  bool committing = false, ended = false;
  // SHA-256 of the rows, read back from the staged file in order as the
  // written rows form a longer prefix, on its own thread: no put waits for
  // it. Commit waits for the tail (while the workers load) only to check
  // an announced sha256; otherwise the hash finishes in the background.
  std::unique_ptr<StagedFileHasher> hasher;
  Clock::time_point begun;

  ~Update() { hasher.reset(); }  // its thread reads the staged file
  v1::LmHeadUpdate Proto(std::optional<int64_t> rows_received = std::nullopt) const {
    v1::LmHeadUpdate p;
    p.set_update_id(id);
    p.set_head(head);
    p.set_version(version);
    p.set_vocab_size(next.source.vocab_size);
    p.set_rows_received(rows_received ? *rows_received : intake->rows_received());
    return p;
  }
};

LmHeadUpdates::LmHeadUpdates(Options options, LmHeads* heads, std::shared_ptr<LmHeadReleases> releases,
                             LmHeadWorkers workers, LmHeadUpdateObservers observers)
    : options_(std::move(options)),
      heads_(heads),
      workers_(std::move(workers)),
      observers_(std::move(observers)),
      releases_(std::move(releases)),
      store_(options_.store_dir),
      released_(releases_, &store_, workers_.drop) {
  loop_ = std::thread([this] { Loop(); });
}

LmHeadUpdates::~LmHeadUpdates() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    while (!open_.empty()) End(open_.begin()->second, "aborted", "the server is stopping");
    cv_.SignalAll();
  }
  loop_.join();
}

absl::StatusOr<std::shared_ptr<LmHeadUpdates::Update>> LmHeadUpdates::Open(const std::string& id) {
  if (auto it = open_.find(id); it != open_.end()) return it->second;
  if (auto it = ended_.find(id); it != ended_.end())
    return absl::NotFoundError(absl::StrCat("lm_head update ", UpdateTag(id), " has ended: ", it->second));
  return absl::NotFoundError(absl::StrCat("lm_head update ", UpdateTag(id), " is not open (unknown id)"));
}

void LmHeadUpdates::End(std::shared_ptr<Update> u, const std::string& outcome, const std::string& why,
                        bool cancel_waiting) {
  u->ended = true;
  cv_.SignalAll();  // a retried Commit waiting for this outcome (Commit)
  open_.erase(u->id);
  if (ended_.size() >= kEndedKept) ended_.erase(ended_.begin());
  ended_[u->id] = outcome == "committed" ? "it was committed" : absl::StrCat("aborted: ", why);
  u->intake->Close(ended_[u->id], cancel_waiting);
  if (outcome_order_.size() >= kOutcomesKept) {
    outcomes_.erase(outcome_order_.front());
    outcome_order_.pop_front();
  }
  outcome_order_.push_back(u->id);
  outcomes_[u->id].status = outcome == "committed"
                                ? absl::OkStatus()
                                : absl::AbortedError(absl::StrCat("lm_head update of \"", u->head, "\" to version \"",
                                                                  u->version, "\" was aborted (", outcome, "): ", why));
  if (outcome != "committed") u->staged->Discard();
  const double seconds = std::chrono::duration<double>(Clock::now() - u->begun).count();
  LogLine() << absl::StrCat("logprob-server: lm_head ", u->head, " update to version ", u->version, " (",
                            UpdateTag(u->id), "): ", outcome,
                            outcome == "committed" ? "" : absl::StrCat(" (", why, ")"), " after ", seconds, " s, ",
                            u->intake->bytes(), " bytes received");
  if (observers_.on_end) observers_.on_end(u->head, outcome, seconds, u->intake->bytes());
}

absl::StatusOr<v1::LmHeadUpdate> LmHeadUpdates::Begin(const v1::BeginLmHeadUpdateRequest& req, absl::Time deadline) {
  if (!options_.allowed)
    return WithReason(absl::FailedPreconditionError("lm_head updates are off on this server (start it with "
                                                    "--allow-lm-head-updates)"),
                      v1::LM_HEAD_UPDATES_DISABLED);
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadName(req.head(), "head"));
  LOGPROB_RETURN_IF_ERROR(CheckLmHeadVersionName(req.version(), "version"));
  // Versions the last commit let go: dropped now, so their files can take
  // this update's rows (an RL loop updates right after the last commit).
  released_.Release();
  LOGPROB_ASSIGN_OR_RETURN(const std::string sha, CheckBeginFields(req));
  absl::StatusOr<std::shared_ptr<const LmHeadVersion>> current = heads_->Current(req.head());
  if (!current.ok() || (*current)->head != req.head())
    return absl::NotFoundError(absl::StrCat("head \"", req.head(), "\": the server holds no such lm_head"));
  if (heads_->Frozen(req.head()))
    return absl::FailedPreconditionError(absl::StrCat("head \"", req.head(),
                                                      "\": this lm_head is frozen (--lm-head-frozen); updates to it "
                                                      "are refused"));
  const LmHeadSource& cur = (*current)->source;
  LOGPROB_RETURN_IF_ERROR(CheckBeginShape(req, cur));
  // A version name is taken for the life of its head: the same bytes again
  // are a no-op, other bytes ALREADY_EXISTS (retained, released or pinned).
  if (auto taken = heads_->Taken(req.head(), req.version()))
    return TakenVersionAnswer(req, sha, cur.vocab_size, *taken);
  v1::Tensor new_bias;
  LOGPROB_ASSIGN_OR_RETURN(const LmHeadTransform transform, UpdatedTransform(req, cur, &new_bias));
  const int64_t V = cur.vocab_size, H = cur.hidden_size;
  const int64_t row_bytes = H * static_cast<int64_t>(DTypeSize(cur.dtype));
  // The current version's shape and dtype: what a worker holds of each version.
  const int64_t per_worker = (*current)->bytes_per_worker;
  LOGPROB_RETURN_IF_ERROR(
      CheckVersionRoom(*heads_, store_, req.head(), per_worker, options_.memory_bytes, options_.store_files_per_head));

  auto u = std::make_shared<Update>();
  u->id = RandomId();  // 128 bits: the capability to put, commit and abort it (unguessable)
  u->head = req.head();
  u->version = req.version();
  u->expected_sha256 = sha;
  u->client_token = req.client_token();
  u->begun = Clock::now();
  u->intake = std::make_unique<RowIntake>(
      RowIntake::Options{absl::StrCat("lm_head update ", UpdateTag(u->id)), cur.dtype, V, H, workers_.stage,
                         observers_.on_bytes ? [on = observers_.on_bytes, head = req.head()](int64_t n) { on(head, n); }
                                             : std::function<void(int64_t)>()});
  std::optional<std::shared_future<std::string>> taken;
  {
    absl::MutexLock lock(&mu_);
    for (;;) {
      std::shared_ptr<Update> same_bytes;  // another caller's open update of exactly this version and sha256
      for (const auto& [id, o] : open_) {
        if (o->head != req.head()) continue;
        // The opener's retry (its first answer was lost): the same update.
        if (!o->client_token.empty() && o->client_token == req.client_token() && o->version == req.version() &&
            o->expected_sha256 == sha)
          return o->Proto();
        if (!sha.empty() && o->version == req.version() && o->expected_sha256 == sha) {
          same_bytes = o;
          break;
        }
        // Never the id: it is the capability to put, commit and abort.
        return absl::FailedPreconditionError(absl::StrCat(
            "lm_head \"", req.head(), "\" has an open update (to version \"", o->version, "\", opened ",
            static_cast<int64_t>(std::chrono::duration<double>(Clock::now() - o->begun).count()),
            " s ago): its opener must commit or abort it, or it times out after --lm-head-update-timeout"));
      }
      if (!same_bytes) break;
      // Several ranks pushing the same weight as the same version: one
      // uploads, the others wait for its outcome (committed: the no-op
      // answer below; aborted: this caller opens the update itself).
      while (!same_bytes->ended)
        if (cv_.WaitWithDeadline(&mu_, deadline) && !same_bytes->ended)
          return absl::DeadlineExceededError(
              absl::StrCat("lm_head \"", req.head(), "\": another caller's update to version \"", req.version(),
                           "\" with this sha256 is still open; its outcome is this call's answer (retry)"));
    }
    // Checked again with the open updates under one lock: a concurrent
    // Begin of this name either committed (taken) or is still open.
    taken = heads_->Taken(req.head(), req.version());
    if (!taken) {
      u->staged = std::make_unique<StagedVersion>(&store_, req.head());
      u->next.source.file = u->staged->file();
      u->bias_given = req.has_bias();
      open_[u->id] = u;
    }
  }
  if (taken) return TakenVersionAnswer(req, sha, cur.vocab_size, *taken);
  u->next.head = req.head();
  u->next.serial = heads_->NewSerial();
  u->next.version = req.version();
  u->next.origin = kUpdateOrigin;
  u->next.bytes_per_worker = per_worker;
  LmHeadSource& s = u->next.source;
  s.tensor = kLmHeadTensor;
  s.dtype = cur.dtype;
  s.vocab_size = V;
  s.hidden_size = H;
  // The head's transform, with what the request changes. A bias of the
  // request, or the head's bias from the store (another version's file,
  // removed with it), becomes this version's own file; a bias in the head's
  // start-up checkpoint is read from there.
  s.transform = transform;
  s.bias = cur.bias;
  s.config_file = cur.config_file;
  if (req.has_bias() || store_.IsOwnBias(cur.bias.file)) {
    const absl::StatusOr<LmHeadBiasSource> written = req.has_bias()
                                                         ? LmHeadStore::WriteBias(u->staged->bias_file(), new_bias)
                                                         : LmHeadStore::CopyBias(cur.bias, u->staged->bias_file());
    if (!written.ok()) {
      absl::MutexLock lock(&mu_);
      End(u, "aborted", std::string(written.status().message()));
      return written.status();
    }
    s.bias = *written;
  }
  if (const absl::Status st = u->staged->Create(cur.dtype, V, H); !st.ok()) {
    absl::MutexLock lock(&mu_);
    End(u, "aborted", std::string(st.message()));
    return absl::Status(st.code(), absl::StrCat("lm_head update: ", st.message(), " (--lm-head-store-dir)"));
  }
  s.data_offset = u->staged->data_offset();
  u->hasher =
      std::make_unique<StagedFileHasher>(u->staged->fd(), s.data_offset, V * row_bytes, /*background=*/sha.empty());
  LogLine() << absl::StrCat("logprob-server: lm_head ", u->head, " update to version ", u->version, " (",
                            UpdateTag(u->id), ") opened: [", V, ", ", H, "] ", DTypeName(cur.dtype));
  return u->Proto();
}

absl::StatusOr<v1::LmHeadUpdate> LmHeadUpdates::Put(const v1::LmHeadRows& put, const LmHeadPutIo& io) {
  switch (put.source_case()) {
    case v1::LmHeadRows::kFile:
      if (put.row_begin() != 0)
        return absl::InvalidArgumentError("LmHeadRows.file gives every row: row_begin must be 0");
      return PutFile(put.update_id(), put.file().path(), put.file().tensor());
    case v1::LmHeadRows::kRows:
      break;
    default:
      return absl::InvalidArgumentError("LmHeadRows: rows or file is needed");
  }
  const v1::Tensor& t = put.rows();
  if (t.shape_size() != 2 || t.shape(0) <= 0 || t.shape(1) <= 0)
    return absl::InvalidArgumentError("LmHeadRows.rows: shape [n, hidden_size] with n, hidden_size > 0 expected");
  if (!IsFloatDType(t.dtype())) return absl::InvalidArgumentError("LmHeadRows.rows: dtype F32, BF16 or F16 expected");
  const int64_t n = t.shape(0), columns = t.shape(1);
  if (t.source_case() == v1::Tensor::kData || t.source_case() == v1::Tensor::SOURCE_NOT_SET) {
    // Inline bytes; the rest, if the transport has more, follow (its size
    // is checked against the update's rows with any source's).
    const uint64_t whole_rows = t.data().size() / DTypeSize(t.dtype()) / static_cast<uint64_t>(columns);
    if (whole_rows < static_cast<uint64_t>(n) && io.follow)
      return PutRowsWith(put.update_id(), put.row_begin(), n, t.dtype(), columns, io);
    const std::shared_ptr<const InputSource> inline_rows = MemorySource(t.data());
    return PutRows(put.update_id(), put.row_begin(), n, t.dtype(), columns, *inline_rows);
  }
  if (!options_.inputs)
    return absl::InvalidArgumentError("LmHeadRows.rows: a memory reference cannot be resolved by this caller");
  LOGPROB_ASSIGN_OR_RETURN(const std::shared_ptr<const InputSource> source,
                           options_.inputs->ResolveTensor(t, "rows", io.caller));
  return PutRows(put.update_id(), put.row_begin(), n, t.dtype(), columns, *source);
}

absl::StatusOr<std::shared_ptr<LmHeadUpdates::Update>> LmHeadUpdates::Find(const std::string& id) {
  absl::MutexLock lock(&mu_);
  return Open(id);
}

absl::StatusOr<v1::LmHeadUpdate> LmHeadUpdates::PutRows(const std::string& id, int64_t row_begin, int64_t rows,
                                                        DType dtype, int64_t columns, const InputSource& source) {
  LOGPROB_ASSIGN_OR_RETURN(const std::shared_ptr<Update> u, Find(id));
  LOGPROB_ASSIGN_OR_RETURN(const int64_t received,
                           u->intake->Put(*u->staged, *u->hasher, row_begin, rows, dtype, columns, source));
  return u->Proto(received);
}

absl::StatusOr<v1::LmHeadUpdate> LmHeadUpdates::PutRowsWith(const std::string& id, int64_t row_begin, int64_t rows,
                                                            DType dtype, int64_t columns, const LmHeadPutIo& io) {
  LOGPROB_ASSIGN_OR_RETURN(const std::shared_ptr<Update> u, Find(id));
  LOGPROB_ASSIGN_OR_RETURN(const int64_t received, u->intake->PutFollowing(*u->staged, *u->hasher, row_begin, rows,
                                                                           dtype, columns, io.follow, io.cancel));
  return u->Proto(received);
}

absl::StatusOr<v1::LmHeadUpdate> LmHeadUpdates::PutFile(const std::string& id, const std::string& path,
                                                        const std::string& tensor) {
  LOGPROB_ASSIGN_OR_RETURN(const std::unique_ptr<CheckpointRows> source,
                           CheckpointRows::OpenBeneath(options_.update_dir, path, tensor, kMaxUpdateFileMetadataBytes));
  const LmHeadSource& src = source->source();
  // Names are relative to update_dir; the bias as the update names its own.
  LmHeadBiasSource src_bias = src.bias;
  if (!src_bias.file.empty()) src_bias.file = (fs::path(options_.update_dir) / src_bias.file).string();
  int64_t V = 0, H = 0;
  DType dtype = v1::DTYPE_UNSPECIFIED;
  LmHeadTransform transform;
  LmHeadBiasSource bias;
  bool bias_given = false;
  {
    absl::MutexLock lock(&mu_);
    LOGPROB_ASSIGN_OR_RETURN(auto u, Open(id));
    V = u->next.source.vocab_size;
    H = u->next.source.hidden_size;
    dtype = u->next.source.dtype;
    transform = u->next.source.transform;
    bias = u->next.source.bias;
    bias_given = u->bias_given;
  }
  // Rows replace the weight only; the update's transform was fixed at Begin
  // (the head's, or what Begin gave). A checkpoint that says otherwise
  // would be scored wrong: refused.
  if (src.transform.has_bias && !bias_given && !(src_bias == bias))
    return absl::InvalidArgumentError(absl::StrCat(
        "file.path \"", path, "\": the checkpoint has ", src.bias.tensor,
        ", but rows replace the weight only and the update keeps the head's bias (",
        transform.has_bias ? bias.file : std::string("none"), "); send the bias in BeginLmHeadUpdateRequest.bias"));
  if (!src.config_file.empty() &&  // a bare file states no scalars
      (src.transform.logit_scale != transform.logit_scale || src.transform.softcap != transform.softcap))
    return absl::InvalidArgumentError(absl::StrCat("file.path \"", path, "\": the checkpoint's logit transform (",
                                                   src.transform.ToString(), ", from ", src.config_file,
                                                   ") is not the update's (", transform.ToString(),
                                                   "); give the scalars in BeginLmHeadUpdateRequest"));
  if (src.vocab_size != V || src.hidden_size != H || src.dtype != dtype)
    return absl::InvalidArgumentError(absl::StrCat("file.path \"", path, "\": ", src.tensor, " is [", src.vocab_size,
                                                   ", ", src.hidden_size, "] ", DTypeName(src.dtype),
                                                   "; the update is [", V, ", ", H, "] ", DTypeName(dtype)));
  return PutRows(id, 0, V, dtype, H, *source);
}

absl::StatusOr<v1::LmHeadInfo> LmHeadUpdates::Commit(const std::string& id) {
  std::shared_ptr<Update> u;
  {
    absl::MutexLock lock(&mu_);
    // A retried Commit (or one after a time-out): how the update ended.
    if (auto it = outcomes_.find(id); it != outcomes_.end() && !open_.count(id)) {
      if (!it->second.status.ok()) return it->second.status;
      return it->second.info;
    }
    LOGPROB_ASSIGN_OR_RETURN(u, Open(id));
    if (u->committing) {
      // A retry while the first Commit runs: its outcome, once it ends.
      Update* const w = u.get();
      while (!w->ended) cv_.Wait(&mu_);  // End signals cv_
      auto it = outcomes_.find(id);
      if (it == outcomes_.end()) return absl::AbortedError(absl::StrCat("lm_head update ", UpdateTag(id), " ended"));
      if (!it->second.status.ok()) return it->second.status;
      return it->second.info;
    }
    LOGPROB_RETURN_IF_ERROR(u->intake->Seal());
    u->committing = true;
  }
  auto fail = [&](const std::string& outcome, absl::Status st) -> absl::Status {
    if (workers_.drop) workers_.drop(u->next.Ref());
    absl::MutexLock lock(&mu_);
    if (!u->ended) End(u, outcome, std::string(st.message()));
    if (auto it = outcomes_.find(u->id); it != outcomes_.end()) it->second.status = st;  // a retry gets this error
    return st;
  };
  if (absl::Status st = u->staged->Commit(); !st.ok()) return fail("aborted", st);
  // NaN and infinite weights are refused (every put scanned its rows).
  if (absl::Status st = u->intake->CheckFinite(u->staged->rows()); !st.ok()) return fail("non_finite", st);
  // Every worker loads its slice while scoring goes on with the current
  // version; meanwhile the hasher finishes the weight's SHA-256, which the
  // commit waits for only to check an announced one.
  std::future<absl::StatusOr<int64_t>> loading =
      std::async(std::launch::async, [this, load = u->next.Load()] { return workers_.load(load); });
  const absl::StatusOr<std::string> sha = u->expected_sha256.empty() ? std::string() : u->hasher->Finish();
  absl::StatusOr<int64_t> generation = loading.get();
  if (!sha.ok()) return fail("aborted", sha.status());
  if (!u->expected_sha256.empty() && u->expected_sha256 != *sha)
    return fail("sha256_mismatch", absl::InvalidArgumentError(absl::StrCat(
                                       "lm_head update ", UpdateTag(id), ": the rows' sha256 is ", *sha,
                                       ", the update announced ", u->expected_sha256, "; nothing changed")));
  u->next.sha256 = u->expected_sha256.empty() ? u->hasher->digest() : KnownSha256(*sha);
  if (!generation.ok())
    return fail("worker_error",
                absl::Status(generation.status().code(),
                             absl::StrCat("lm_head update ", UpdateTag(id), ": loading on the workers failed: ",
                                          generation.status().message(), "; nothing changed")));
  const int64_t g = *generation;
  const auto serving = workers_.serving;
  if (absl::Status st = heads_->Commit(u->next, [&serving, g] { return !serving || serving(g); }); !st.ok())
    return fail("worker_error", st);
  v1::LmHeadInfo committed;
  {
    absl::MutexLock lock(&mu_);
    End(u, "committed", "");
    // A retried Commit's answer, set with the outcome (under the lock a
    // retry waiting for this commit wakes under).
    for (const v1::LmHeadInfo& info : heads_->List())
      if (info.name() == u->head) committed = info;
    outcomes_[u->id].info = committed;
    // The digest may still be computing: the hasher lives on until it is.
    u->hasher->Start();
    u->staged->Keep(std::move(u->hasher));
  }
  if (committed.name().empty()) return absl::InternalError("the committed head vanished");
  return committed;
}

absl::StatusOr<v1::LmHeadUpdate> LmHeadUpdates::Abort(const std::string& id) {
  absl::MutexLock lock(&mu_);
  LOGPROB_ASSIGN_OR_RETURN(auto u, Open(id));
  if (u->committing)
    return absl::FailedPreconditionError(
        absl::StrCat("lm_head update ", UpdateTag(id), " is being committed; it cannot be aborted"));
  End(u, "aborted", "the client aborted it");
  v1::LmHeadUpdate p = u->Proto();
  p.set_aborted(true);
  p.set_abort_reason("the client aborted it");
  return p;
}

void LmHeadUpdates::Loop() {
  for (;;) {
    // Released versions: the workers drop them; the store's files go.
    released_.Tidy();
    if (observers_.on_store_bytes) observers_.on_store_bytes(store_.Bytes());
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    const auto now = Clock::now();
    std::vector<std::shared_ptr<Update>> idle;
    for (const auto& [id, u] : open_)
      if (!u->committing && now - u->intake->last_progress() > options_.timeout) idle.push_back(u);
    for (const auto& u : idle) {
      // A put stalled waiting for bytes: its call is ended too (the
      // handler thread is freed; the put answers ABORTED naming this).
      End(u, "timeout",
          absl::StrCat("no progress for ", std::chrono::duration<double>(options_.timeout).count(),
                       " s (--lm-head-update-timeout)"),
          /*cancel_waiting=*/true);
    }
    cv_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
  }
}

}  // namespace logprob
