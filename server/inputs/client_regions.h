// Shared-memory inputs: POSIX shared-memory regions that same-host clients
// register (RegisterSharedMemory) so their request tensors travel as
// (region, offset, byte_size) references instead of bytes in the message.
//
// Safety model. A client may truncate, unlink or rewrite its region at any
// time, and a read through a mapping of a truncated object raises SIGBUS.
// The front-end keeps the object's file descriptor and maps it read-only,
// and copies what a request needs out of that mapping with
// CopyFromMappedFile (common/mapped_file_copy.h), which turns a SIGBUS
// inside the copy into a failed copy (memcpy speed: about 3x pread's on
// tmpfs). A failed copy, or a region that cannot be mapped, is read again
// with pread(2), which returns a short count (never a signal) when the
// object has shrunk; the request then fails with FAILED_PRECONDITION and
// the server goes on (RegionSource, server/inputs/shared_inputs.h).
//
// Who may register a region: only a process that can write the object
// (docs/security.md). The server runs as the objects' owner and could
// open a 0600 object that the caller cannot, so naming one proves
// nothing. Register opens the object and answers a random challenge;
// the region stays unconfirmed (Find refuses it, nothing of it is read)
// until Confirm has read the challenge back from the object's last
// kProofBytes bytes through the descriptor opened at registration, the
// one every later read uses (no window to swap the object in between).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/shared_memory.h"  // kShmProofBytes

namespace logprob {

/// Bytes of the proof of write access: the challenge's size, and the tail
/// of the object (past byte_size) where the client writes it.
inline constexpr int64_t kProofBytes = kShmProofBytes;

/// What Register answers: the challenge to write at proof_offset.
struct RegionChallenge {
  std::string challenge;  // kProofBytes random bytes
  int64_t proof_offset = 0;
};

/// One registered region: the open object (O_RDONLY). Immutable; closed
/// when the last request using it and the registry have let it go.
class ClientRegion {
 public:
  /// Opens POSIX shared-memory object `shm_name` for region `name`.
  /// Errors: INVALID_ARGUMENT (bad names, byte_size <= 0, object smaller
  /// than byte_size + kProofBytes), NOT_FOUND (no such object), PERMISSION_DENIED (not a
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
  /// Where the proof lies: the object's size when it was opened, minus
  /// kProofBytes (>= byte_size).
  int64_t proof_offset() const { return proof_offset_; }
  int fd() const { return fd_; }
  /// True when bytes [proof_offset, proof_offset + kProofBytes) of the
  /// object equal `challenge` (compared in constant time; false if they
  /// cannot be read). Reads through fd(), never by name.
  bool HoldsProof(const std::string& challenge) const;
  /// Copies bytes [offset, offset + n) of the object to `dst` (from the
  /// region's mapping, else with pread). If the object has shrunk below
  /// them, zero-fills the rest of `dst` and returns FAILED_PRECONDITION
  /// naming the region and the bytes. Thread-safe.
  absl::Status Read(int64_t offset, size_t n, char* dst) const;

 private:
  ClientRegion(std::string name, std::string shm_name, int64_t byte_size, int64_t proof_offset, int fd, const char* map)
      : name_(std::move(name)),
        shm_name_(std::move(shm_name)),
        byte_size_(byte_size),
        proof_offset_(proof_offset),
        fd_(fd),
        map_(map) {}
  /// Read's fallback: pread through fd_.
  absl::Status ReadWithPread(int64_t offset, size_t n, char* dst) const;
  std::string name_, shm_name_;
  int64_t byte_size_;
  int64_t proof_offset_;
  int fd_;
  const char* map_;  // bytes [0, byte_size_) mapped read-only; null: none (pread only)
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

  /// Registers `shm_name` as `name` of session `owner`, unconfirmed, and
  /// returns its challenge (ClientRegion::Open errors). ALREADY_EXISTS if
  /// the session has `name`; RESOURCE_EXHAUSTED beyond max_regions or
  /// max_bytes (unconfirmed regions count).
  absl::StatusOr<RegionChallenge> Register(const std::string& owner, const std::string& name,
                                           const std::string& shm_name, int64_t byte_size) ABSL_LOCKS_EXCLUDED(mu_);
  /// Confirms `name` of `owner`: OK when the object holds its challenge
  /// (ClientRegion::HoldsProof) or it is confirmed already; else
  /// PERMISSION_DENIED naming the region, and the registration is removed.
  /// NOT_FOUND for a name the session has not registered.
  absl::Status Confirm(const std::string& owner, const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  /// Removes `name` of `owner` (all of its regions when empty) and returns
  /// how many went; NOT_FOUND for an unknown name. Requests in flight keep
  /// their reader until they end.
  absl::StatusOr<int> Unregister(const std::string& owner, const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  struct Listed {
    std::shared_ptr<const ClientRegion> region;
    bool confirmed;
  };
  /// The session's regions, by name, confirmed or not.
  std::vector<Listed> List(const std::string& owner) ABSL_LOCKS_EXCLUDED(mu_);
  /// Confirmed region `name` of `owner`; NOT_FOUND when the session has
  /// none of that name (whoever else may have one), PERMISSION_DENIED
  /// when it is not confirmed.
  absl::StatusOr<std::shared_ptr<const ClientRegion>> Find(const std::string& owner, const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Keeps session `owner` from expiring while the returned object lives
  /// (a request in flight), and marks it active when it goes.
  std::shared_ptr<void> Hold(const std::string& owner) ABSL_LOCKS_EXCLUDED(mu_);
  /// Removes the regions of sessions idle for longer than idle_timeout at
  /// `now` with no Hold() alive; returns how many regions went (the reaper
  /// calls it).
  int ExpireIdle(std::chrono::steady_clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_);

  const Options& options() const { return options_; }

 private:
  struct Entry {
    std::shared_ptr<const ClientRegion> region;
    std::string challenge;  // cleared once confirmed
    bool confirmed = false;
  };
  struct Session {
    std::map<std::string, Entry> regions;
    std::chrono::steady_clock::time_point last_used;
    int in_flight = 0;  // Hold()s alive
  };
  void Changed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when stop_ is set
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  int64_t regions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

}  // namespace logprob
