#include "common/host_bytes.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace logprob {

HostBytes::HostBytes(std::vector<char> bytes) : owned_(std::move(bytes)), data_(owned_.data()), size_(owned_.size()) {}

HostBytes::HostBytes(const HostBytes& other)
    : owned_(other.owned_),
      mapping_(other.mapping_),
      data_(mapping_ ? other.data_ : owned_.data()),
      size_(other.size_) {}

// A moved vector keeps its buffer, so data_ stays valid.
HostBytes::HostBytes(HostBytes&& other) noexcept
    : owned_(std::move(other.owned_)),
      mapping_(std::move(other.mapping_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

HostBytes& HostBytes::operator=(HostBytes other) noexcept {
  owned_.swap(other.owned_);
  mapping_.swap(other.mapping_);
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  return *this;
}

absl::StatusOr<HostBytes> HostBytes::MapMemoryFile(const std::string& path, uint64_t offset, size_t size,
                                                   FileMapper* mapper) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", strerror(errno)));
  struct statfs fs {};
  struct stat st {};
  const bool in_memory = fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC;
  const bool stat_ok = fstat(fd, &st) == 0;
  if (!in_memory || !stat_ok || size == 0 || offset > static_cast<uint64_t>(st.st_size) ||
      size > static_cast<uint64_t>(st.st_size) - offset) {
    close(fd);
    if (!in_memory) return absl::UnimplementedError(absl::StrCat(path, " is not in memory (tmpfs): read a copy"));
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", ", offset + size, ") of ", path, " (",
                                              stat_ok ? st.st_size : -1, " bytes) cannot be mapped"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t begin = offset / page * page;
  const size_t length = static_cast<size_t>(offset - begin) + size;
  std::shared_ptr<void> mapping;
  if (mapper != nullptr) {
    mapping = mapper->Map(fd, st, begin, length);
  } else if (void* p = mmap(nullptr, length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, static_cast<off_t>(begin));
             p != MAP_FAILED) {
    mapping = std::shared_ptr<void>(p, [length](void* q) { munmap(q, length); });
  }
  const int err = errno;
  close(fd);  // the mapping keeps the file
  if (mapping == nullptr) return absl::InternalError(absl::StrCat("mmap of ", path, ": ", strerror(err)));
  HostBytes out;
  out.mapping_ = std::move(mapping);
  out.data_ = static_cast<const char*>(out.mapping_.get()) + (offset - begin);
  out.size_ = size;
  return out;
}

}  // namespace logprob
