// POSIX shared memory regions: how the front-end hands a work item's
// logits or hidden states to a worker on the same host without sending
// them through gRPC (one copy instead of serialize + socket + parse).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace logprob {

/// A named shared memory region (shm_open + mmap) of `size()` bytes.
/// The creator owns the name: its destructor unmaps and unlinks it; an
/// opener only unmaps. The creator holds a shared flock(2) on the object
/// for the region's life, which RemoveStaleRegions reads as "alive" in any
/// PID namespace. Not copyable.
class SharedRegion {
 public:
  /// Creates a new region named "/logprob-<pid>-<n>" (mode 0600) and
  /// reserves and maps its pages (posix_fallocate, MAP_POPULATE), so a full
  /// /dev/shm is RESOURCE_EXHAUSTED here rather than SIGBUS on first write.
  /// Errors: RESOURCE_EXHAUSTED (no space), INTERNAL (other system errors).
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(size_t bytes);
  /// The same, named `name` ("/" then the name; the creator chooses it,
  /// e.g. a client's "/logprob-client-<pid>-<random>"); ALREADY_EXISTS if
  /// an object of that name exists.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(size_t bytes, const std::string& name);
  /// Maps an existing region, whole and read-only. Errors: NOT_FOUND (no
  /// such name), INTERNAL (other system errors).
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Open(const std::string& name);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }
  /// Writable for the creator; an opener must only read.
  char* data() const { return data_; }

 private:
  SharedRegion(std::string name, char* data, size_t size, bool owner, int lock_fd = -1)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner), lock_fd_(lock_fd) {}
  std::string name_;
  char* data_;
  size_t size_;
  bool owner_;
  int lock_fd_;  // the creator's descriptor holding the flock; -1 for an opener
};

/// The name prefix of this process's SharedRegion::Create(bytes) regions:
/// "/logprob-<pid>-" (what JoinReply.payload_region_prefix carries).
std::string OwnRegionPrefix();

/// True when `name` is `prefix` followed by decimal digits only: a region
/// SharedRegion::Create(bytes) made in the process whose OwnRegionPrefix
/// is `prefix` (never a client's region, nor another path). An empty
/// `prefix` matches every "/logprob-<digits>-<digits>".
bool IsPoolRegionName(const std::string& name, const std::string& prefix);

/// True while a shared-memory object named `name` ("/" then the name)
/// exists: its creator has not unlinked it (SharedRegion's destructor).
/// One shm_open; errors other than "no such object" count as existing.
bool SharedObjectExists(const std::string& name);

/// Unlinks the regions SharedRegion::Create made in processes that no
/// longer exist (/dev/shm/logprob-<pid>-<n>, e.g. after a SIGKILL), and
/// lm_head stores of older releases (the directories
/// /dev/shm/logprob-<pid>-lm-heads; stores are now server/heads/store_folder.h's),
/// and returns how many. A region is stale only when its PID names no
/// process here AND nobody holds its flock (its creator holds one while it
/// lives, whatever PID namespace it runs in: a server in a nested namespace
/// sharing /dev/shm names its regions by a PID that may be dead here) AND
/// it was not modified within the last minute (a region being created takes
/// its lock a moment after its name exists). Best effort: errors are ignored. Nothing in a
/// nested PID namespace, where the PIDs of a shared /dev/shm may be other
/// namespaces' live servers of releases that took no lock.
int RemoveStaleRegions();

/// This host's shared-memory namespace identity (ServerInfo.host_id): the
/// first 32 hex digits of SHA-256("<boot_id>:<st_dev of /dev/shm>")
/// (boot_id from /proc/sys/kernel/random/boot_id, st_dev in decimal), so
/// two processes agree exactly when they run on one kernel and see one
/// /dev/shm mount (containers with their own /dev/shm differ). Empty if
/// neither can be read.
std::string SharedMemoryHostId();

/// gRPC metadata key naming a client's shared-memory session
/// (server/transport/shm_session.h; the C++ and Python clients send it).
inline constexpr char kShmSessionMetadata[] = "logprob-shm-session";

/// Bytes of a client region's proof of write access (logprob.v1
/// RegisterSharedMemoryResponse.challenge): the object's last bytes, past
/// the registered byte_size, hold the server's challenge when the client
/// confirms (server/inputs/client_regions.h, docs/security.md).
inline constexpr int64_t kShmProofBytes = 32;

}  // namespace logprob
