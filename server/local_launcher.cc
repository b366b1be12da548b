#include "server/local_launcher.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

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

LocalLauncher::LocalLauncher(int workers, std::string binary, std::vector<std::string> args)
    : workers_(workers), binary_(std::move(binary)), args_(std::move(args)) {}

LocalLauncher::~LocalLauncher() { Stop(); }

absl::Status LocalLauncher::Launch(int64_t, const std::string& frontend) {
  for (int w = 0; w < workers_; ++w) {
    std::vector<std::string> args = {binary_, "--frontend=" + frontend, "--rejoin=false", "--exit-with-parent"};
    args.insert(args.end(), args_.begin(), args_.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (int err = posix_spawn(&pid, binary_.c_str(), nullptr, nullptr, argv.data(), environ); err != 0)
      return absl::UnavailableError(absl::StrCat("cannot start worker ", binary_, ": ", strerror(err)));
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
