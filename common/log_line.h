// One line of a program's log on stderr, written with a single write(2).
//
// The server and the workers it spawns share one stderr. std::cerr is
// unbuffered, so `std::cerr << a << b << std::endl` is a write per piece,
// and the pieces of two processes' lines interleave in the log. A LogLine
// gathers its pieces and writes the whole line at once when the statement
// ends: lines up to PIPE_BUF (4096) bytes then never mix on a pipe, and
// a file opened with O_APPEND gets whole lines too.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <sstream>
#include <string>

namespace logprob {

/// Usage: `LogLine() << "logprob-worker: rank " << rank << " ready";`
/// (no std::endl: the line ends, with '\n', when the temporary dies).
class LogLine {
 public:
  LogLine() = default;
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  ~LogLine() {
    out_ << '\n';
    const std::string line = out_.str();
    size_t done = 0;
    while (done < line.size()) {
      const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
  }

  template <typename T>
  LogLine& operator<<(const T& value) {
    out_ << value;
    return *this;
  }

 private:
  std::ostringstream out_;
};

}  // namespace logprob
