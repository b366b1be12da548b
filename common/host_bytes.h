// Read-only bytes in host memory: an owned buffer, or a range of a file in
// memory (tmpfs) mapped read-only, whose pages stay shared with the file.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace logprob {

/// How HostBytes::MapMemoryFile maps a checked file range: the default
/// maps anew and unmaps when the last copy goes; a pool may keep a mapping
/// for the next one of the same file range (common/standby_mappings.h).
class FileMapper {
 public:
  virtual ~FileMapper() = default;
  /// A read-only, populated MAP_SHARED mapping of `length` bytes of the
  /// open tmpfs file `fd` (described by `st`: identity, size) from the
  /// page-aligned offset `begin`; its deleter releases it. Null with errno
  /// set when mmap fails. `fd` stays the caller's (dup it to keep it).
  virtual std::shared_ptr<void> Map(int fd, const struct stat& st, uint64_t begin, size_t length) = 0;
};

/// Bytes a reader does not change: either a std::vector it owns or a
/// read-only shared mapping of a file range (MapMemoryFile), unmapped when
/// the last copy goes. Copies share a mapping and copy an owned buffer.
/// Not synchronised: const use from any number of threads.
class HostBytes {
 public:
  HostBytes() = default;
  /// Owns `bytes` (implicit: a buffer is bytes).
  HostBytes(std::vector<char> bytes);  // NOLINT: implicit
  HostBytes(const HostBytes& other);
  HostBytes(HostBytes&& other) noexcept;
  HostBytes& operator=(HostBytes other) noexcept;

  /// Bytes [offset, offset + size) of the file at `path`, mapped read-only
  /// (MAP_SHARED, pages populated now, so first use does not fault), when
  /// the file lives in memory (tmpfs, e.g. /dev/shm): no copy is made and
  /// the pages are the file's. The file must not be truncated or written
  /// while mapped (an lm_head store file: immutable until every worker
  /// dropped its version). UNIMPLEMENTED when the file is not on tmpfs (a
  /// disk or network file's pages could be evicted or go stale: read a
  /// copy instead); NOT_FOUND when it cannot be opened; OUT_OF_RANGE when
  /// the range is past its end; INTERNAL when mmap fails. `mapper` (null:
  /// a fresh mapping) maps the checked range.
  static absl::StatusOr<HostBytes> MapMemoryFile(const std::string& path, uint64_t offset, size_t size,
                                                 FileMapper* mapper = nullptr);

  const char* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  /// True for a mapping (MapMemoryFile), false for an owned buffer.
  bool mapped() const { return mapping_ != nullptr; }

 private:
  std::vector<char> owned_;
  std::shared_ptr<void> mapping_;  // the whole page-aligned mapping; munmap when the last copy goes
  const char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace logprob
