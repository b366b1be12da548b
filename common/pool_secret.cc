#include "common/pool_secret.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/random_id.h"

namespace logprob {
namespace {

constexpr size_t kMinChars = 16;
constexpr size_t kMaxChars = 4096;

/// Reads all of `fd` from offset 0, at most kMaxChars + 1 bytes.
absl::StatusOr<std::string> ReadAll(int fd, const std::string& where) {
  std::string text(kMaxChars + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = pread(fd, text.data() + got, text.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": cannot read: ", std::strerror(errno)));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  return text;
}

}  // namespace

PoolSecret PoolSecret::Generate() { return PoolSecret(RandomId(32)); }

absl::StatusOr<PoolSecret> PoolSecret::Parse(const std::string& text, const std::string& where) {
  const std::string trimmed(absl::StripAsciiWhitespace(text));
  if (trimmed.size() < kMinChars || trimmed.size() > kMaxChars)
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": a pool secret has ", kMinChars, " to ", kMaxChars,
                     " characters (e.g. `openssl rand -hex 32`), this one ",
                     trimmed.size() > kMaxChars ? "more" : std::to_string(trimmed.size())));
  for (const char c : trimmed)
    if (c < 0x21 || c > 0x7e)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the pool secret holds a character that is not printable ASCII (or a space)"));
  return PoolSecret(trimmed);
}

absl::StatusOr<PoolSecret> PoolSecret::FromFile(const std::string& path) {
  const std::string where = "--internal-secret-file " + path;
  // O_NONBLOCK: a FIFO at the path is refused below, never waited on.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": cannot open: ", std::strerror(errno)));
  struct stat st {};
  absl::StatusOr<std::string> text;
  if (fstat(fd, &st) != 0) {
    text = absl::InvalidArgumentError(absl::StrCat(where, ": fstat: ", std::strerror(errno)));
  } else if (!S_ISREG(st.st_mode)) {
    text = absl::InvalidArgumentError(absl::StrCat(where, ": not a regular file"));
  } else if ((st.st_mode & S_IROTH) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    text = absl::InvalidArgumentError(absl::StrCat(where, ": other users can read it (mode ", mode,
                                                   "): chmod o-r it (a Kubernetes Secret: defaultMode 0400)"));
  } else {
    text = ReadAll(fd, where);
  }
  close(fd);
  if (!text.ok()) return text.status();
  return Parse(*text, where);
}

absl::StatusOr<PoolSecret> PoolSecret::FromFd(int fd) {
  const std::string where = absl::StrCat("--internal-secret-fd ", fd);
  absl::StatusOr<std::string> text = ReadAll(fd, where);
  if (!text.ok()) return text.status();
  return Parse(*text, where);
}

absl::StatusOr<int> PoolSecret::ToInheritableFd() const {
  const int fd = memfd_create("logprob-pool-secret", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  size_t put = 0;
  while (put < value_.size()) {
    const ssize_t n = write(fd, value_.data() + put, value_.size() - put);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("writing the pool secret: ", std::strerror(err)));
    }
    put += static_cast<size_t>(n);
  }
  // Nobody changes it afterwards (a child could otherwise rewrite it for its siblings).
  fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
  return fd;
}

}  // namespace logprob
