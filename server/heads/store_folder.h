// The lm_head store's folder of one front-end process start: a unique name
// under a root (/dev/shm by default, or --lm-head-store-dir), locked with
// flock(2) for the process's life, so the next start (in a container, the
// same PID 1 again) tells a dead front-end's folder from a live one's by
// the lock, not by its PID, and two front-ends sharing a root never write
// the same file.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace logprob {

/// A folder `<root>/logprob-lm-heads-<pid>-<start ns>-<random>` that this
/// process holds locked (an exclusive flock on `<folder>/.lock`, taken
/// before the folder appears under that name; the descriptor is
/// close-on-exec, so workers do not inherit it). Removed with what it
/// holds when this is destroyed. Not copyable; thread-compatible.
class StoreFolder {
 public:
  /// Removes the stale store folders under `root` (StoreFolder names whose
  /// lock nobody holds: their front-end exited), then makes this process's
  /// folder there (`root` made if missing). `*removed`, when given, counts
  /// the stale folders removed. INTERNAL naming `root` and the system error
  /// when the folder cannot be made or locked.
  static absl::StatusOr<std::unique_ptr<StoreFolder>> Make(const std::string& root, int* removed = nullptr);
  ~StoreFolder();
  StoreFolder(const StoreFolder&) = delete;
  StoreFolder& operator=(const StoreFolder&) = delete;

  /// The folder (absolute when `root` was).
  const std::string& path() const { return path_; }

 private:
  StoreFolder(std::string path, int lock_fd) : path_(std::move(path)), lock_fd_(lock_fd) {}
  std::string path_;
  int lock_fd_;
};

/// Removes every folder under `root` named like a StoreFolder whose lock
/// file is not locked (its owner is gone; a folder without a lock file is
/// left alone). Best effort; returns how many were removed.
int RemoveStaleStoreFolders(const std::string& root);

}  // namespace logprob
