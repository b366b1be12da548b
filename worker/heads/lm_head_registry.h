// The lm_head versions a worker holds: each (head name, version) as this
// rank's vocabulary slice loaded into the backend (ScoringBackend::
// LoadLmHead). The front-end decides which versions exist (server/
// lm_heads.h) and names one in every hidden-states work item.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/lm_head_precision.h"
#include "common/standby_mappings.h"
#include "logprob/internal/v1/worker.pb.h"
#include "worker/heads/frontend_lm_head_rows.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// The files a worker may open for LoadLmHead (issue 42): the front-end's
/// committed store files (a name directly in `store_dir`, not ".partial":
/// common/lm_head_store_name.h, the rule of the front-end's
/// ReadLmHeadRows) and the files (weight and bias) of the versions the
/// JoinReply named (`named`: the startup heads' checkpoints, wherever the
/// operator put them). Every later version is a store file. Immutable.
struct LmHeadFileRule {
  std::string store_dir;
  std::set<std::string> named;
  /// The rule for a worker that joined with `joined`.
  static LmHeadFileRule Of(const internal::v1::JoinReply& joined);
  /// Whether `file` may be opened.
  bool Allows(const std::string& file) const;
};

/// A worker's servable lm_head versions by (name, version, serial): the
/// serial is the version's identity (LmHeadRef.serial). Thread-safe:
/// Load and Drop run while items are scored; an item keeps the weights it
/// found (Find) alive until it ends, so Drop never frees weights in use.
class LmHeadRegistry {
 public:
  /// Slices are rows SplitRange(V, world, rank) of each head; `precision`
  /// picks the GEMM operands (common/lm_head_precision.h). `backend`
  /// outlives the registry. `fetch` reads a slice from the front-end
  /// instead of the file when `fetch_mode` says so (ShouldFetchLmHead;
  /// empty: never). With `files`, Load opens only the files it allows (a
  /// slice fetched from the front-end opens none), PERMISSION_DENIED for
  /// any other: the worker's registry; without (any file), tests and
  /// benchmarks.
  LmHeadRegistry(ScoringBackend& backend, LmHeadPrecision precision, int rank, int world, LmHeadRowFetcher fetch = {},
                 LmHeadFetchMode fetch_mode = LmHeadFetchMode::kNever, std::optional<LmHeadFileRule> files = {})
      : backend_(backend),
        precision_(precision),
        rank_(rank),
        world_(world),
        fetch_(std::move(fetch)),
        fetch_mode_(fetch_ ? fetch_mode : LmHeadFetchMode::kNever),
        files_(std::move(files)) {}

  /// Reads this rank's rows of `load.source` (common/lm_head_source.h
  /// ReadLmHeadRows; a committed update's file in memory is mapped, not
  /// read; or fetched from the front-end, see the constructor) and loads them into the backend, unless `load.head` is
  /// held already from the same file and offset (then nothing is read; held from another file, the old copy is stale
  /// and is replaced). Returns the bytes the backend holds for it. Errors: INVALID_ARGUMENT for an empty name or
  /// version or a bad shape; PERMISSION_DENIED for a file the LmHeadFileRule does not allow (before it is opened);
  /// NOT_FOUND / DATA_LOSS reading the file; the backend's LoadLmHead errors (memory).
  absl::StatusOr<int64_t> Load(const internal::v1::LmHeadLoad& load) ABSL_LOCKS_EXCLUDED(mu_);

  /// The weights of `head`, or null when this worker does not hold it.
  std::shared_ptr<const LmHeadWeights> Find(const internal::v1::LmHeadRef& head) const ABSL_LOCKS_EXCLUDED(mu_);

  /// Forgets `head` (freed when the items using it end); false if not held.
  bool Drop(const internal::v1::LmHeadRef& head) ABSL_LOCKS_EXCLUDED(mu_);

  /// Versions held.
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::tuple<std::string, std::string, uint64_t>;  // (name, version, serial)
  static Key KeyOf(const internal::v1::LmHeadRef& ref) { return Key{ref.name(), ref.version(), ref.serial()}; }

  ScoringBackend& backend_;
  const LmHeadPrecision precision_;
  const int rank_, world_;
  const LmHeadRowFetcher fetch_;
  const LmHeadFetchMode fetch_mode_;
  const std::optional<LmHeadFileRule> files_;  // unset: any file
  // Slices mapped from store files, kept once dropped: the store recycles a
  // released version's file for a later update, whose load then maps
  // nothing (two spares per head in the store: room for two heads).
  StandbyMappings standby_{4};
  mutable absl::Mutex mu_;
  struct Held {
    std::shared_ptr<const LmHeadWeights> weights;
    std::string file;  // where they were loaded from (LmHeadSource.file, data_offset)
    uint64_t data_offset = 0;
    // Its source's transform (scalars, bias location), serialized: a load of
    // the same version with another transform replaces it too.
    std::string transform;
  };
  std::map<Key, Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace logprob
