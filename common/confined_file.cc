#include "common/confined_file.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/positioned_io.h"

namespace logprob {
namespace {

constexpr int kOpenFlags = O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY;

// The named error of a failed open (errno `err`) of `path`.
absl::Status OpenError(int err, const std::string& field, const std::string& path) {
  const std::string name = absl::StrCat(field, field.empty() ? "" : " ", "\"", path, "\"");
  switch (err) {
    case ELOOP:  // a symlink (RESOLVE_NO_SYMLINKS, O_NOFOLLOW)
    case EXDEV:  // would leave the directory (RESOLVE_BENEATH)
      return absl::PermissionDeniedError(
          absl::StrCat(name, ": symlinks and \"..\" are not followed beneath --lm-head-update-dir"));
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(absl::StrCat(name, ": no such file"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(absl::StrCat(name, ": the server may not read it"));
    default:
      return absl::NotFoundError(absl::StrCat(name, ": cannot open it: ", std::generic_category().message(err)));
  }
}

// fstat's checks of an opened `fd`.
absl::StatusOr<OpenedFile> Checked(UniqueFd fd, const std::string& field, const std::string& path, bool dir_ok) {
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return OpenError(errno, field, path);
  OpenedFile f;
  f.is_dir = S_ISDIR(st.st_mode);
  if (!S_ISREG(st.st_mode) && !(dir_ok && f.is_dir))
    return absl::FailedPreconditionError(absl::StrCat(field, field.empty() ? "" : " ", "\"", path, "\": not a ",
                                                      dir_ok ? "regular file or directory" : "regular file"));
  f.size = f.is_dir ? 0 : static_cast<uint64_t>(st.st_size);
  f.fd = std::move(fd);
  return f;
}

// The O_NOFOLLOW walk (kernels without openat2): each directory component
// opened with O_PATH | O_NOFOLLOW from the one before and checked to be a
// directory, not a symlink (ELOOP, as openat2 says).
int WalkBeneath(int root_fd, const std::vector<std::string>& parts) {
  UniqueFd dir;
  int at = root_fd;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    UniqueFd next(openat(at, parts[i].c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
    if (!next.valid()) return -1;
    struct stat st;
    if (fstat(next.get(), &st) != 0) return -1;
    if (!S_ISDIR(st.st_mode)) {
      errno = S_ISLNK(st.st_mode) ? ELOOP : ENOTDIR;
      return -1;
    }
    at = next.get();
    dir = std::move(next);
  }
  return openat(at, parts.back().c_str(), kOpenFlags | O_NOFOLLOW);
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

void UniqueFd::reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::StatusOr<OpenedFile> OpenBeneath(int root_fd, const std::string& path, const std::string& field, bool dir_ok) {
  return OpenBeneathWith(root_fd, path, field, dir_ok, /*walk=*/false);
}

absl::StatusOr<OpenedFile> OpenBeneathWith(int root_fd, const std::string& path, const std::string& field, bool dir_ok,
                                           bool walk) {
  const std::string name = absl::StrCat(field, field.empty() ? "" : " ", "\"", path, "\"");
  if (path.find('\0') != std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(field, ": a path must not hold a NUL byte"));
  if (path.empty() || path[0] == '/')
    return absl::PermissionDeniedError(
        absl::StrCat(name, ": give a path relative to the server's --lm-head-update-dir"));
  std::vector<std::string> parts;
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    if (part == "..") return absl::PermissionDeniedError(absl::StrCat(name, ": \"..\" is not allowed"));
    if (part != ".") parts.emplace_back(part);
  }
  if (parts.empty()) parts.emplace_back(".");
  open_how how{};
  how.flags = static_cast<uint64_t>(kOpenFlags);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  long fd = -1;
  errno = ENOSYS;
  if (!walk) {
    // EAGAIN: a rename raced the lookup (retried a bounded number of times).
    for (int tries = 0; tries < 64; ++tries) {
      fd = syscall(SYS_openat2, root_fd, path.c_str(), &how, sizeof(how));
      if (fd >= 0 || (errno != EINTR && errno != EAGAIN)) break;
    }
  }
  if (fd < 0 && errno == ENOSYS) fd = WalkBeneath(root_fd, parts);
  if (fd < 0) return OpenError(errno, field, path);
  return Checked(UniqueFd(static_cast<int>(fd)), field, path, dir_ok);
}

absl::StatusOr<OpenedFile> OpenTrusted(const std::string& path, bool dir_ok) {
  const int fd = open(path.c_str(), kOpenFlags);
  if (fd < 0)
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::generic_category().message(errno)));
  return Checked(UniqueFd(fd), "", path, dir_ok);
}

absl::StatusOr<std::string> ReadWholeFile(int fd, const std::string& name, uint64_t max_bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return absl::DataLossError(absl::StrCat("cannot read ", name));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) return absl::InvalidArgumentError(absl::StrCat(name, ": larger than ", max_bytes, " bytes"));
  std::string out(size, '\0');
  if (!PreadAll(fd, out.data(), size, 0)) return absl::DataLossError(absl::StrCat("cannot read ", name));
  return out;
}

}  // namespace logprob
