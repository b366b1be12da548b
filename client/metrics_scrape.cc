#include "client/metrics_scrape.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace logprob::client {
namespace {

// Closes a socket when it goes out of scope.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) close(fd);
  }
};

absl::Status Unavailable(const std::string& url, const std::string& what) {
  return absl::UnavailableError(absl::StrCat("--metrics-url ", url, ": ", what));
}

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& url, double timeout_seconds) {
  constexpr absl::string_view kScheme = "http://";
  if (!absl::StartsWith(url, kScheme)) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics-url ", url, ": expected http://HOST:PORT[/PATH]"));
  }
  absl::string_view rest = absl::string_view(url).substr(kScheme.size());
  const size_t slash = rest.find('/');
  const std::string host_port(rest.substr(0, slash));
  const std::string path = slash == absl::string_view::npos ? "/metrics" : std::string(rest.substr(slash));
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics-url ", url, ": expected http://HOST:PORT[/PATH]"));
  }
  const std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return Unavailable(url, absl::StrCat("cannot resolve: ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addrs(found, freeaddrinfo);
  FdCloser sock{-1};
  std::string connect_error = "no address";
  for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
    sock.fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (sock.fd < 0) continue;
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(timeout_seconds);
    tv.tv_usec = static_cast<suseconds_t>((timeout_seconds - std::floor(timeout_seconds)) * 1e6);
    setsockopt(sock.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(sock.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(sock.fd, a->ai_addr, a->ai_addrlen) == 0) break;
    connect_error = std::strerror(errno);
    close(sock.fd);
    sock.fd = -1;
  }
  if (sock.fd < 0) return Unavailable(url, absl::StrCat("cannot connect: ", connect_error));

  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port, "\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(sock.fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return Unavailable(url, absl::StrCat("cannot send: ", std::strerror(errno)));
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  char buf[16384];
  for (;;) {
    const ssize_t n = recv(sock.fd, buf, sizeof buf, 0);
    if (n == 0) break;
    if (n < 0) return Unavailable(url, absl::StrCat("cannot read: ", std::strerror(errno)));
    answer.append(buf, static_cast<size_t>(n));
  }
  const size_t header_end = answer.find("\r\n\r\n");
  const std::string status_line = answer.substr(0, answer.find("\r\n"));
  if (header_end == std::string::npos || !absl::StartsWith(status_line, "HTTP/") ||
      !absl::StrContains(status_line, " 200")) {
    return Unavailable(url, absl::StrCat("unexpected answer '", status_line.substr(0, 80), "'"));
  }
  return answer.substr(header_end + 4);
}

HistogramTotals ParseHistogramTotals(absl::string_view text, absl::string_view name, absl::string_view label) {
  HistogramTotals totals;
  const std::string sum_name = absl::StrCat(name, "_sum");
  const std::string count_name = absl::StrCat(name, "_count");
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    // NAME{LABELS} VALUE [TIMESTAMP] or NAME VALUE [TIMESTAMP]
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos) continue;
    const absl::string_view sample = line.substr(0, name_end);
    double* into = sample == sum_name ? &totals.sum : sample == count_name ? &totals.count : nullptr;
    if (into == nullptr) continue;
    absl::string_view labels;
    absl::string_view after = line.substr(name_end);
    if (after[0] == '{') {
      const size_t close = after.find('}');
      if (close == absl::string_view::npos) continue;
      labels = after.substr(1, close - 1);
      after = after.substr(close + 1);
    }
    if (!label.empty() && !absl::StrContains(labels, label)) continue;
    std::vector<absl::string_view> fields = absl::StrSplit(after, ' ', absl::SkipEmpty());
    double value = 0;
    if (!fields.empty() && absl::SimpleAtod(fields[0], &value)) *into += value;
  }
  return totals;
}

}  // namespace logprob::client
