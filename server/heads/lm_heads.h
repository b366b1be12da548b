// The front-end's named lm_heads and their versions: which version of which
// head a request is scored with (bound at admission), which versions stay
// servable (--lm-head-retain), and which every worker must hold.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/lm_head_source.h"
#include "logprob/internal/v1/worker.pb.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob {

/// The head a request with an empty ScoreRequest.head uses.
inline constexpr const char* kDefaultLmHead = "default";
/// The version name of a head loaded at start (unless --lm-head-version).
inline constexpr const char* kInitialLmHeadVersion = "initial";

/// LmHeadVersion::origin of a version an update committed (its file is in
/// the server's store: immutable while a worker holds the version).
inline constexpr char kUpdateOrigin[] = "update";

/// One version of a named lm_head: where its [V, H] weight is (a
/// safetensors tensor each worker reads its rows SplitRange(V, W, rank) of)
/// and what it is. Immutable.
struct LmHeadVersion {
  std::string head;     // the head's name
  std::string version;  // opaque
  // The version's identity (LmHeadRef.serial): unique per server process
  // and never reused; what workers load, find and drop by, with the names.
  // 0 until LmHeads::Add or LmHeads::NewSerial gives one.
  uint64_t serial = 0;
  LmHeadSource source;  // the weight's file, tensor, dtype, shape
  // Hex SHA-256 of the weight bytes, row-major: known at load (a head
  // loaded at start, an update that announced it) or computed in the
  // background after the commit ("" if reading the file back failed).
  std::shared_future<std::string> sha256;
  // What the largest worker's slice holds (LmHeadWorkerBytes: the slice in
  // source.dtype on CPU workers, the GEMM operands on GPU workers).
  int64_t bytes_per_worker = 0;
  std::string origin;  // "PATH[:TENSOR]" given at start, or kUpdateOrigin
  // When it became current (LmHeads::Commit), ms since the Unix epoch;
  // 0 for a version loaded at start (LmHeadInfo.committed_unix_ms).
  int64_t committed_unix_ms = 0;

  /// sha256 if computed, else "" (never waits).
  std::string Sha256IfKnown() const;
  /// The worker protocol's name for it.
  internal::v1::LmHeadRef Ref() const;
  /// What a worker loads (LmHeadRegistry::Load).
  internal::v1::LmHeadLoad Load() const;
};

/// A digest already known, as LmHeadVersion::sha256.
std::shared_future<std::string> KnownSha256(std::string hex);

/// Checks a head name: 1..64 characters of [A-Za-z0-9._-] (in updates and
/// in scoring requests). INVALID_ARGUMENT naming `field`, the name echoed
/// escaped and cut (Printable).
/// INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckLmHeadName(const std::string& name, const std::string& field);
/// Checks a version name: 1..128 characters of [A-Za-z0-9._:+-] (in
/// updates and in scoring requests' head_version). INVALID_ARGUMENT as
/// CheckLmHeadName.
absl::Status CheckLmHeadVersionName(const std::string& version, const std::string& field);

/// The heads of a server and their servable versions. A head has a current
/// version (new requests use it) and up to `retain` committed versions
/// (the current one included) that requests may pin. A version leaves when
/// it is neither retained nor bound to a request: `on_release` is called
/// then (from the thread that dropped the last binding; it must not block
/// or call back into LmHeads). Thread-safe.
class LmHeads {
 public:
  struct Options {
    int retain = 1;  // >= 1
    /// The GEMM operands' name per weight dtype ("bf16", "tf32", "fp32"),
    /// for ServerInfo; may be empty.
    std::function<std::string(DType)> precision_of;
    std::function<void(const LmHeadVersion&)> on_release;
    /// Heads no update may change (--lm-head-frozen).
    std::set<std::string> frozen;
  };

  explicit LmHeads(Options options) : options_(std::move(options)) {}

  /// Adds a head with its first version (given a serial if it has none).
  /// ALREADY_EXISTS for a second head of the same name.
  absl::Status Add(LmHeadVersion first) ABSL_LOCKS_EXCLUDED(mu_);

  /// Adds a head declared by shape and dtype (server/heads/lm_head_declared.h:
  /// `placeholder` from ParseDeclaredLmHead): it has no servable version
  /// until the first Commit, so Bind refuses it (FAILED_PRECONDITION
  /// naming the head) and workers load nothing for it; updates see its
  /// shape through Current. ALREADY_EXISTS for a second head of the name.
  absl::Status Declare(LmHeadVersion placeholder) ABSL_LOCKS_EXCLUDED(mu_);

  /// Head `name`'s current version, a declared head's placeholder
  /// included (what an update checks its shape against), unbound.
  /// NOT_FOUND for an unknown head, as Bind.
  absl::StatusOr<std::shared_ptr<const LmHeadVersion>> Current(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);

  /// A version identity never given before (LmHeadVersion::serial), for a
  /// version about to be loaded and committed. Thread-safe.
  uint64_t NewSerial() ABSL_LOCKS_EXCLUDED(mu_);

  /// The sha256 of the version that took name `version` of head `name`, if
  /// any did: a version name is taken for the life of its head (whether the
  /// version is retained, released or held by a request), so it names one
  /// weight only. nullopt when the head or the name is unknown.
  std::optional<std::shared_future<std::string>> Taken(const std::string& name, const std::string& version) const
      ABSL_LOCKS_EXCLUDED(mu_);

  /// True when head `name` is frozen (--lm-head-frozen). Thread-safe (no lock).
  bool Frozen(const std::string& name) const { return options_.frozen.count(name) > 0; }

  /// True when no head was added.
  bool empty() const ABSL_LOCKS_EXCLUDED(mu_);

  /// The version a request scores with: head `name` (empty: "default", or
  /// the only head), at version `pinned` if set (it must be retained), else
  /// its current version. The binding keeps the version alive.
  /// NOT_FOUND for an unknown head (naming the heads held);
  /// FAILED_PRECONDITION (reason LM_HEAD_VERSION_UNAVAILABLE) for a
  /// version not retained, naming the retained ones, and for a declared
  /// head no update has filled yet.
  absl::StatusOr<std::shared_ptr<const LmHeadVersion>> Bind(const std::string& name, const std::string& pinned) const
      ABSL_LOCKS_EXCLUDED(mu_);

  /// The retained version `version` of head `name`, or null.
  std::shared_ptr<const LmHeadVersion> Find(const std::string& name, const std::string& version) const
      ABSL_LOCKS_EXCLUDED(mu_);

  /// Makes `next` its head's current version if `still_valid()` (asked
  /// under the lock Alive takes, so a worker joining sees either the old or
  /// the new set; may be empty); the oldest versions beyond `retain` stop
  /// being servable (and are released once unbound). NOT_FOUND for an
  /// unknown head; FAILED_PRECONDITION when still_valid() says no;
  /// ALREADY_EXISTS when the version name was taken before (Taken: checked
  /// and taken under one lock, so two commits of one name cannot both pass).
  absl::Status Commit(LmHeadVersion next, const std::function<bool()>& still_valid = {}) ABSL_LOCKS_EXCLUDED(mu_);

  /// Every version not yet released (retained, or bound to a request), for
  /// the workers that join: LmHeadLoad of each.
  std::vector<internal::v1::LmHeadLoad> Alive() const ABSL_LOCKS_EXCLUDED(mu_);

  /// ServerInfo.lm_heads, by name.
  std::vector<v1::LmHeadInfo> List() const ABSL_LOCKS_EXCLUDED(mu_);

  /// The LmHeadInfo of version `v` of a head this holds, as List gives the
  /// current one (retained_versions and frozen: the head's now; sha256 if
  /// known). NOT_FOUND for an unknown head.
  absl::StatusOr<v1::LmHeadInfo> Describe(const LmHeadVersion& v) const ABSL_LOCKS_EXCLUDED(mu_);

  /// Bytes per worker of every version not yet released.
  int64_t AliveBytesPerWorker() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Head {
    std::deque<std::shared_ptr<const LmHeadVersion>> retained;     // newest first; front is current
    std::map<std::string, std::shared_future<std::string>> names;  // every version name taken -> its sha256
  };
  /// The head a request names (see Bind). mu_ held.
  absl::StatusOr<const Head*> Named(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// LmHeadInfo of version `v` of head `head` named `name`. mu_ held.
  v1::LmHeadInfo InfoOf(const std::string& name, const Head& head, const LmHeadVersion& v) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// A shared version whose last release calls on_release.
  std::shared_ptr<const LmHeadVersion> Share(LmHeadVersion v);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Head> heads_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;
  /// Every version shared so far and not yet released (expired entries are
  /// pruned as they are seen).
  mutable std::vector<std::weak_ptr<const LmHeadVersion>> alive_ ABSL_GUARDED_BY(mu_);
};

}  // namespace logprob
