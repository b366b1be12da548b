// Opening files a request names: once, read-only, without blocking, and
// (for names a client gives) beneath one directory without following any
// symlink, so the file checked is the file read (docs/security.md).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace logprob {

/// An owned file descriptor, closed when it goes. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  /// Gives up ownership: the descriptor, -1 left here.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  /// Closes the descriptor held (if any).
  void reset();

 private:
  int fd_ = -1;
};

/// A file opened read-only (O_NONBLOCK, O_CLOEXEC, O_NOCTTY): a regular
/// file, or a directory when the opener allowed one.
struct OpenedFile {
  UniqueFd fd;
  bool is_dir = false;
  uint64_t size = 0;  // st_size of a regular file
};

/// Opens `path` (relative) beneath the directory `root_fd` with
/// openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
/// — or, on kernels without openat2 (ENOSYS), a walk from `root_fd` that
/// opens each component with O_NOFOLLOW — read-only, non-blocking (a FIFO
/// or device never blocks) and close-on-exec, then checks with fstat that
/// it is a regular file (or, when `dir_ok`, a directory) before any byte
/// is read: the caller reads only through the descriptor returned.
/// Errors name `path` as given (prefixed with `field`), never what a file
/// holds: PERMISSION_DENIED for an empty or absolute path, a ".."
/// component or a symlink at any component (decided without looking
/// outside the directory, so they tell nothing about files there);
/// NOT_FOUND when no such file is beneath the directory; FAILED_PRECONDITION
/// for something that is not a regular file (a FIFO, a device, a socket,
/// a directory when !dir_ok). Thread-safe.
absl::StatusOr<OpenedFile> OpenBeneath(int root_fd, const std::string& path, const std::string& field,
                                       bool dir_ok = false);

/// OpenBeneath, with the O_NOFOLLOW component walk when `walk` (else
/// openat2, the walk only on ENOSYS): the walk is what kernels before 5.6
/// get, reachable here so that tests cover it. Same answers.
absl::StatusOr<OpenedFile> OpenBeneathWith(int root_fd, const std::string& path, const std::string& field, bool dir_ok,
                                           bool walk);

/// Opens `path` as an operator gives it (command-line flags: symlinks
/// are followed) with the same flags and checks as OpenBeneath: NOT_FOUND
/// when it cannot be opened, FAILED_PRECONDITION when it is not a regular
/// file (or directory, when `dir_ok`). Thread-safe.
absl::StatusOr<OpenedFile> OpenTrusted(const std::string& path, bool dir_ok = false);

/// Reads the whole of the regular file `fd` (at most `max_bytes`; more is
/// INVALID_ARGUMENT naming `name`) with positioned reads. DATA_LOSS when a
/// read fails.
absl::StatusOr<std::string> ReadWholeFile(int fd, const std::string& name, uint64_t max_bytes);

}  // namespace logprob
