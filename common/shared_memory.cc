#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace logprob {
namespace {

absl::Status SystemError(const std::string& what, int err) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == ENOMEM) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  return absl::InternalError(msg);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(size_t bytes) {
  static std::atomic<uint64_t> counter{0};
  const std::string name = absl::StrCat("/logprob-", getpid(), "-", counter++);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return SystemError("shm_open " + name, errno);
  const size_t size = bytes == 0 ? 1 : bytes;  // mmap refuses 0 bytes
  // posix_fallocate returns the error number (it does not set errno).
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return SystemError(absl::StrCat("reserving ", size, " bytes of shared memory (/dev/shm) for ", name), err);
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return SystemError("mmap " + name, err);
  }
  return std::unique_ptr<SharedRegion>(new SharedRegion(name, static_cast<char*>(p), size, 0, size, true));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Open(const std::string& name, size_t offset,
                                                                 size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return SystemError("shm_open " + name, errno);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return SystemError("fstat " + name, err);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (offset > size || bytes > size - offset) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory ", name, " holds ", size, " bytes, not [", offset, ", ", offset + bytes, ")"));
  }
  // mmap needs a page-aligned offset and a non-empty length.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t start = offset / page * page, skip = offset - start;
  const size_t length = std::max<size_t>(skip + bytes, 1);
  void* p = mmap(nullptr, length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, static_cast<off_t>(start));
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) return SystemError("mmap " + name, err);
  return std::unique_ptr<SharedRegion>(new SharedRegion(name, static_cast<char*>(p), length, skip, bytes, false));
}

SharedRegion::~SharedRegion() {
  munmap(map_, map_size_);
  if (owner_) shm_unlink(name_.c_str());
}

}  // namespace logprob
