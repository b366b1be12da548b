#include "server/heads/store_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/random_id.h"

namespace logprob {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "logprob-lm-heads-";       // a store folder's name starts so
constexpr char kMaking[] = ".logprob-lm-heads-new-";  // ... while its lock is taken
constexpr char kLockFile[] = ".lock";

absl::Status Failed(const std::string& what, int err) {
  return absl::InternalError(absl::StrCat("lm_head store: ", what, ": ", std::strerror(err)));
}

}  // namespace

int RemoveStaleStoreFolders(const std::string& root) {
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, kPrefix) || !entry.is_directory(ec)) continue;
    const std::string lock = (entry.path() / kLockFile).string();
    const int fd = open(lock.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;  // no lock file: not ours to judge
    // Held: its front-end is alive (in this PID namespace or another).
    const bool stale = flock(fd, LOCK_EX | LOCK_NB) == 0;
    if (stale && fs::remove_all(entry.path(), ec) > 0 && !ec) ++removed;
    close(fd);  // the lock (if taken) goes with it
  }
  return removed;
}

absl::StatusOr<std::unique_ptr<StoreFolder>> StoreFolder::Make(const std::string& root, int* removed) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return absl::InternalError(absl::StrCat("lm_head store: cannot make ", root, ": ", ec.message()));
  const int stale = RemoveStaleStoreFolders(root);
  if (removed != nullptr) *removed = stale;
  // Unique per process start: PID, start time and random bits (a restarted
  // container's front-end has the same PID).
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const std::string unique =
      absl::StrCat(getpid(), "-", std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(), "-", RandomId(4));
  // Made under a temporary name and locked, then renamed: a folder under
  // the final name is locked from its first moment (another front-end's
  // RemoveStaleStoreFolders never sees it unlocked).
  const std::string making = absl::StrCat(root, "/", kMaking, unique);
  const std::string path = absl::StrCat(root, "/", kPrefix, unique);
  if (mkdir(making.c_str(), 0700) != 0) return Failed("cannot make " + making, errno);
  const std::string lock = making + "/" + kLockFile;
  const int fd = open(lock.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 || flock(fd, LOCK_EX | LOCK_NB) != 0 || rename(making.c_str(), path.c_str()) != 0) {
    const int err = errno;
    if (fd >= 0) close(fd);
    fs::remove_all(making, ec);
    return Failed("cannot lock " + making, err);
  }
  return std::unique_ptr<StoreFolder>(new StoreFolder(path, fd));
}

StoreFolder::~StoreFolder() {
  std::error_code ec;
  fs::remove_all(path_, ec);
  close(lock_fd_);
}

}  // namespace logprob
