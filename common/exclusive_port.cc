#include "common/exclusive_port.h"

#include <dirent.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace logprob {

std::map<std::string, int> ListeningTcpSockets() {
  std::map<std::string, int> sockets;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
      std::istringstream fields(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
      if (!(fields >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode)) continue;
      const size_t colon = local.rfind(':');
      unsigned int p = 0;
      if (state != "0A" || colon == std::string::npos ||
          !absl::SimpleHexAtoi(absl::string_view(local).substr(colon + 1), &p))
        continue;
      sockets[inode] = static_cast<int>(p);
    }
  }
  return sockets;
}

namespace {

/// Inodes of the TCP sockets listening on `port` (/proc/net/tcp, tcp6).
std::set<std::string> ListeningInodes(int port) {
  std::set<std::string> inodes;
  for (const auto& [inode, p] : ListeningTcpSockets())
    if (p == port) inodes.insert(inode);
  return inodes;
}

/// "pid N, COMM" of the processes holding one of `inodes`, those whose
/// descriptors this process may read.
std::vector<std::string> Holders(const std::set<std::string>& inodes) {
  std::vector<std::string> out;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return out;
  while (const dirent* e = readdir(proc)) {
    int pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid) || pid == getpid()) continue;
    const std::string fd_dir = absl::StrCat("/proc/", pid, "/fd");
    DIR* fds = opendir(fd_dir.c_str());
    if (fds == nullptr) continue;
    bool holds = false;
    while (const dirent* f = readdir(fds)) {
      char target[64];
      const ssize_t n = readlink(absl::StrCat(fd_dir, "/", f->d_name).c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      target[n] = 0;
      const std::string link(target);
      if (link.rfind("socket:[", 0) == 0 && inodes.count(link.substr(8, link.size() - 9))) {
        holds = true;
        break;
      }
    }
    closedir(fds);
    if (!holds) continue;
    std::string comm;
    std::ifstream(absl::StrCat("/proc/", pid, "/comm")) >> comm;
    out.push_back(absl::StrCat("pid ", pid, comm.empty() ? "" : ", " + comm));
  }
  closedir(proc);
  return out;
}

}  // namespace

void ExclusivePorts(grpc::ServerBuilder& builder) { builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0); }

std::string ListenFailure(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return absl::StrCat(address, ": not host:port");
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found); rc != 0)
    return absl::StrCat(address, ": ", gai_strerror(rc));
  int err = 0;
  for (const addrinfo* a = found; a != nullptr && err == 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC and civetweb do
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 1) != 0) err = errno;
    close(fd);
  }
  freeaddrinfo(found);
  if (err == 0)
    return absl::StrCat(address,
                        " could be bound just now (it was busy a moment ago, or the failure was "
                        "something else: see the log above)");
  if (err != EADDRINUSE) return absl::StrCat(address, ": ", std::strerror(err));
  int port_number = 0;
  std::vector<std::string> holders;
  if (absl::SimpleAtoi(port, &port_number)) holders = Holders(ListeningInodes(port_number));
  return absl::StrCat(address, " is already in use (",
                      holders.empty() ? "by another process" : "by " + absl::StrJoin(holders, "; "), ")");
}

}  // namespace logprob
