// Shared-memory inputs: POSIX shared-memory regions that same-host clients
// register (RegisterSharedMemory) so their request tensors travel as
// (region, offset, byte_size) references instead of bytes in the message.
//
// Safety model. The front-end never maps a client's region: a client may
// truncate, unlink or rewrite it at any time, and a read through a mapping
// of a truncated object raises SIGBUS. The front-end keeps the object's
// file descriptor instead and copies what a request needs with pread(2),
// which returns a short count (never a signal) when the object has shrunk;
// the request then fails with FAILED_PRECONDITION and the server goes on.
// Each region also reserves an address range (PROT_NONE, no memory) so a
// request's rows can be named by addresses like inline rows (ScoreJob);
// touching one faults, so code that forgets to go through RegionReader is
// caught at once instead of working until a client truncates.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace logprob {

/// One registered region: the open object (O_RDONLY) and its reserved,
/// inaccessible address range of byte_size bytes. Immutable; closed when
/// the last request using it and the registry have let it go.
class ClientRegion {
 public:
  /// Opens POSIX shared-memory object `shm_name` for region `name`.
  /// Errors: INVALID_ARGUMENT (bad names, byte_size <= 0, object smaller
  /// than byte_size), NOT_FOUND (no such object), PERMISSION_DENIED (not a
  /// regular object owned by this process's effective user, a symlink, or
  /// one of the server's own payload regions), INTERNAL (system errors).
  static absl::StatusOr<std::shared_ptr<const ClientRegion>> Open(const std::string& name, const std::string& shm_name,
                                                                  int64_t byte_size);
  ~ClientRegion();
  ClientRegion(const ClientRegion&) = delete;
  ClientRegion& operator=(const ClientRegion&) = delete;

  const std::string& name() const { return name_; }
  const std::string& shm_name() const { return shm_name_; }
  int64_t byte_size() const { return byte_size_; }
  int fd() const { return fd_; }
  /// Start of the reserved range: byte i of the region is named base() + i
  /// (never dereferenced; RegionReader reads it).
  const char* base() const { return base_; }

 private:
  ClientRegion(std::string name, std::string shm_name, int64_t byte_size, int fd, char* base)
      : name_(std::move(name)), shm_name_(std::move(shm_name)), byte_size_(byte_size), fd_(fd), base_(base) {}
  std::string name_, shm_name_;
  int64_t byte_size_;
  int fd_;
  char* base_;
};

/// One request's reads from one region. Thread-safe.
class RegionReader {
 public:
  explicit RegionReader(std::shared_ptr<const ClientRegion> region) : region_(std::move(region)) {}
  const ClientRegion& region() const { return *region_; }
  /// Copies bytes [src, src + n) of the region (addresses from base()) to
  /// `dst` with pread. If the object has shrunk below them, zero-fills the
  /// rest of `dst`, records FAILED_PRECONDITION naming the region (the
  /// first failure is kept) and returns false.
  bool Read(char* dst, const char* src, size_t n) const;
  /// OK, or the first failed Read's error.
  absl::Status status() const;

 private:
  std::shared_ptr<const ClientRegion> region_;
  mutable std::mutex mu_;
  mutable absl::Status status_;
};

/// The registered regions of all sessions, with the server's caps and the
/// idle expiry. A session is an opaque owner key (ScoringService derives
/// it from the `logprob-shm-session` metadata, the peer's host and the
/// bearer token); regions of one session are invisible to the others.
/// Thread-safe; a reaper thread expires idle sessions.
class ClientRegions {
 public:
  struct Options {
    int64_t max_bytes = int64_t{16} << 30;  // byte_size of all regions together
    int max_regions = 64;                   // regions of all sessions together
    /// A session with no call for this long loses its regions.
    std::chrono::milliseconds idle_timeout{std::chrono::minutes(5)};
    /// Called with the registered regions and their bytes after every
    /// change (metrics gauges). May be empty.
    std::function<void(int64_t regions, int64_t bytes)> on_change;
  };
  explicit ClientRegions(Options options);
  ~ClientRegions();  // stops the reaper

  /// Registers `shm_name` as `name` of session `owner` (ClientRegion::Open
  /// errors). ALREADY_EXISTS if the session has `name`;
  /// RESOURCE_EXHAUSTED beyond max_regions or max_bytes.
  absl::Status Register(const std::string& owner, const std::string& name, const std::string& shm_name,
                        int64_t byte_size);
  /// Removes `name` of `owner` (all of its regions when empty) and returns
  /// how many went; NOT_FOUND for an unknown name. Requests in flight keep
  /// their reader until they end.
  absl::StatusOr<int> Unregister(const std::string& owner, const std::string& name);
  /// The session's regions, by name.
  std::vector<std::shared_ptr<const ClientRegion>> List(const std::string& owner);
  /// Region `name` of `owner`; NOT_FOUND when the session has none of
  /// that name (whoever else may have one).
  absl::StatusOr<std::shared_ptr<const ClientRegion>> Find(const std::string& owner, const std::string& name);
  /// Keeps session `owner` from expiring while the returned object lives
  /// (a request in flight), and marks it active when it goes.
  std::shared_ptr<void> Hold(const std::string& owner);
  /// Removes the regions of sessions idle for longer than idle_timeout at
  /// `now` with no Hold() alive; returns how many regions went (the reaper
  /// calls it).
  int ExpireIdle(std::chrono::steady_clock::time_point now);

  const Options& options() const { return options_; }

 private:
  struct Session {
    std::map<std::string, std::shared_ptr<const ClientRegion>> regions;
    std::chrono::steady_clock::time_point last_used;
    int in_flight = 0;  // Hold()s alive
  };
  void Changed();  // lock held

  const Options options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Session> sessions_;
  int64_t regions_ = 0, bytes_ = 0;
  bool stop_ = false;
  std::thread reaper_;
};

}  // namespace logprob
