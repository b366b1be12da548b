// Read-only mappings of tmpfs file ranges kept after their last user for
// the next load of the same range: the front-end's lm_head store recycles
// a released version's file for the next update (server/heads/lm_head_store.h),
// so a worker that kept its slice's mapping loads the new version without
// mapping anything (no page tables to populate, nothing to unmap).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/host_bytes.h"

namespace logprob {

/// A FileMapper (pass it to HostBytes::MapMemoryFile) that keeps up to
/// `capacity` mappings on standby once their last HostBytes copy is gone,
/// and hands one out again for the same file (device, inode) and range
/// instead of a fresh mmap. On this 2-core VM a populated mapping of a
/// worker's Qwen slice (593 MiB) takes 0.05 s and its munmap 0.02 s, per
/// worker and per lm_head version.
///
/// Memory: a standby mapping shares the file's pages (no copy); it keeps
/// an unlinked file's pages alive only until the next sweep: every second
/// (and at each Map) a standby mapping whose file has no name left
/// (st_nlink 0: the store removed its spare) is unmapped, as is the oldest
/// one beyond `capacity`. A reused mapping shows the file's current bytes
/// (MAP_SHARED), which the new version's writer set before the load.
///
/// Thread-safe. Mappings handed out may outlive the pool (they are then
/// unmapped by their last user).
class StandbyMappings : public FileMapper {
 public:
  explicit StandbyMappings(size_t capacity);
  ~StandbyMappings() override;
  StandbyMappings(const StandbyMappings&) = delete;
  StandbyMappings& operator=(const StandbyMappings&) = delete;

  std::shared_ptr<void> Map(int fd, const struct stat& st, uint64_t begin, size_t length) override;

  /// Unmaps standby mappings whose file was removed; returns how many stay.
  size_t Sweep();
  /// Mappings on standby now, and mappings handed out again (reused) so far.
  size_t standby() const;
  uint64_t reused() const;

 private:
  struct Entry {
    dev_t dev = 0;
    ino_t ino = 0;
    uint64_t begin = 0;
    size_t length = 0;
    void* addr = nullptr;
    int fd = -1;  // kept to see whether the file still has a name
  };
  struct State {
    mutable absl::Mutex mu;
    std::list<Entry> entries ABSL_GUARDED_BY(mu);  // most recent first
    size_t capacity = 0;
    uint64_t reused ABSL_GUARDED_BY(mu) = 0;
    bool stop ABSL_GUARDED_BY(mu) = false;
    absl::CondVar stopped;  // signalled when stop is set
    /// Entry `e` on standby (the oldest beyond capacity, or all when
    /// stopped, unmapped).
    void Put(Entry e) ABSL_LOCKS_EXCLUDED(mu);
    size_t Sweep() ABSL_LOCKS_EXCLUDED(mu);
  };
  static void Release(Entry e);
  std::shared_ptr<State> state_;
  std::thread sweeper_;
};

}  // namespace logprob
