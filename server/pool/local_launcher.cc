#include "server/pool/local_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace logprob {
namespace {

/// "exited with status 3" / "was killed by signal 9".
std::string DescribeExit(int status) {
  if (WIFSIGNALED(status)) return absl::StrCat("was killed by signal ", WTERMSIG(status));
  return absl::StrCat("exited with status ", WEXITSTATUS(status));
}

}  // namespace

LocalLauncher::LocalLauncher(int workers, std::string binary, std::vector<std::string> args, int secret_fd)
    : workers_(workers), binary_(std::move(binary)), args_(std::move(args)) {
  if (secret_fd >= 0) {
    // Kept above kSecretFd, so the child's dup2 is a real copy (which
    // clears close-on-exec on the copy only).
    secret_fd_ = fcntl(secret_fd, F_DUPFD_CLOEXEC, kSecretFd + 1);
    close(secret_fd);
  }
}

LocalLauncher::~LocalLauncher() {
  Stop();
  if (secret_fd_ >= 0) close(secret_fd_);
}

absl::Status LocalLauncher::Launch(int64_t, const std::string& frontend) {
  for (int w = 0; w < workers_; ++w) {
    std::vector<std::string> args = {binary_, "--frontend=" + frontend, "--rejoin=false", "--exit-with-parent"};
    if (secret_fd_ >= 0) args.push_back(absl::StrCat("--internal-secret-fd=", kSecretFd));
    args.insert(args.end(), args_.begin(), args_.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (secret_fd_ >= 0) posix_spawn_file_actions_adddup2(&actions, secret_fd_, kSecretFd);
    pid_t pid;
    const int err = posix_spawn(&pid, binary_.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (err != 0) return absl::UnavailableError(absl::StrCat("cannot start worker ", binary_, ": ", strerror(err)));
    pids_.push_back(pid);
  }
  return absl::OkStatus();
}

std::optional<std::string> LocalLauncher::Poll() {
  for (pid_t& pid : pids_) {
    int status;
    if (pid > 0 && waitpid(pid, &status, WNOHANG) == pid) {
      const pid_t exited = pid;
      pid = -1;  // reaped
      return absl::StrCat("worker process ", exited, " ", DescribeExit(status));
    }
  }
  return std::nullopt;
}

void LocalLauncher::Stop() {
  for (pid_t pid : pids_)
    if (pid > 0) kill(pid, SIGKILL);
  for (pid_t pid : pids_)
    if (pid > 0) waitpid(pid, nullptr, 0);
  pids_.clear();
}

std::string LocalLauncher::Describe() const { return absl::StrCat("spawns ", workers_, " local worker(s)"); }

}  // namespace logprob
