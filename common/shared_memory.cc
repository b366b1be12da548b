#include "common/shared_memory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/sha256.h"

namespace logprob {
namespace {

absl::Status SystemError(const std::string& what, int err) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == ENOMEM) return absl::ResourceExhaustedError(msg);
  if (err == ENOENT) return absl::NotFoundError(msg);
  return absl::InternalError(msg);
}

}  // namespace

std::string OwnRegionPrefix() { return absl::StrCat("/logprob-", getpid(), "-"); }

bool IsPoolRegionName(const std::string& name, const std::string& prefix) {
  const auto digits = [](absl::string_view s) {
    return !s.empty() && s.size() <= 20 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  absl::string_view rest(name);
  if (!prefix.empty()) return absl::ConsumePrefix(&rest, prefix) && digits(rest);
  if (!absl::ConsumePrefix(&rest, "/logprob-")) return false;
  const size_t dash = rest.find('-');
  return dash != absl::string_view::npos && digits(rest.substr(0, dash)) && digits(rest.substr(dash + 1));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(size_t bytes) {
  static std::atomic<uint64_t> counter{0};
  return Create(bytes, absl::StrCat(OwnRegionPrefix(), counter++));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(size_t bytes, const std::string& name) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST) return absl::AlreadyExistsError(absl::StrCat("shm_open ", name, ": ", std::strerror(err)));
    return SystemError("shm_open " + name, err);
  }
  // Held for the region's life: "alive" to RemoveStaleRegions in any PID namespace.
  flock(fd, LOCK_SH | LOCK_NB);
  const size_t size = bytes == 0 ? 1 : bytes;  // mmap refuses 0 bytes
  // posix_fallocate returns the error number (it does not set errno).
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return SystemError(absl::StrCat("reserving ", size, " bytes of shared memory (/dev/shm) for ", name), err);
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  if (p == MAP_FAILED) {
    close(fd);
    shm_unlink(name.c_str());
    return SystemError("mmap " + name, err);
  }
  return std::unique_ptr<SharedRegion>(new SharedRegion(name, static_cast<char*>(p), size, true, fd));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return SystemError("shm_open " + name, errno);
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    const int err = st.st_size <= 0 ? EINVAL : errno;
    close(fd);
    return SystemError("fstat " + name, err);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) return SystemError("mmap " + name, err);
  return std::unique_ptr<SharedRegion>(new SharedRegion(name, static_cast<char*>(p), size, false));
}

bool SharedObjectExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return errno != ENOENT;
  close(fd);
  return true;
}

namespace {
// Whether this process runs in a PID namespace nested in another (a
// container, `unshare --pid`). The initial PID namespace's inode is fixed
// (PROC_PID_INIT_INO); /proc/self/ns/pid names this process's own even
// under a /proc mounted for the nested namespace (`--mount-proc`), where
// /proc/self/status's NSpid, the fallback, lists one PID only.
bool InNestedPidNamespace() {
  constexpr ino_t kInitialPidNamespaceInode = 0xEFFFFFFCu;
  struct stat ns {};
  if (stat("/proc/self/ns/pid", &ns) == 0) return ns.st_ino != kInitialPidNamespaceInode;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("NSpid:", 0) == 0) {
      std::istringstream pids(line.substr(6));
      int n = 0;
      for (long pid = 0; pids >> pid;) ++n;
      return n > 1;
    }
  return false;
}

/// True when `path` (a region in /dev/shm) may belong to a live process:
/// someone holds its flock (its creator, SharedRegion::Create), it was
/// modified within the last minute (made a moment ago: its creator may not
/// hold the lock yet), or it cannot be checked.
bool RegionInUse(const std::filesystem::path& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return true;
  struct stat st {};
  bool in_use = fstat(fd, &st) != 0 || time(nullptr) - st.st_mtime < 60;
  if (!in_use) in_use = flock(fd, LOCK_EX | LOCK_NB) != 0;  // released by close
  close(fd);
  return in_use;
}
}  // namespace

int RemoveStaleRegions() {
  int removed = 0;
  // A region's name holds its creator's PID in the creator's namespace: in
  // a nested namespace that shares /dev/shm with its parent, a live server
  // outside looks dead (kill: ESRCH) and its regions would be unlinked
  // under it. Judge only from the initial namespace.
  if (InNestedPidNamespace()) return 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    int pid = 0;
    if (std::sscanf(name.c_str(), "logprob-%d-", &pid) != 1 || pid <= 0) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to judge)
    if (entry.is_directory(ec)) {                       // an exited server's lm_head store
      if (std::filesystem::remove_all(entry.path(), ec) > 0) ++removed;
      continue;
    }
    if (RegionInUse(entry.path())) continue;
    if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

std::string SharedMemoryHostId() {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  struct stat st;
  const std::string dev = stat("/dev/shm", &st) == 0 ? std::to_string(static_cast<uint64_t>(st.st_dev)) : "";
  if (boot_id.empty() && dev.empty()) return "";
  return Sha256Hex(boot_id + ":" + dev).substr(0, 32);
}

SharedRegion::~SharedRegion() {
  munmap(data_, size_);
  if (owner_) shm_unlink(name_.c_str());
  if (lock_fd_ >= 0) close(lock_fd_);
}

}  // namespace logprob
