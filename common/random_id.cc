#include "common/random_id.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace logprob {

std::string RandomId(int bytes) {
  std::vector<unsigned char> raw(static_cast<size_t>(bytes > 0 ? bytes : 0));
  size_t got = 0;
  while (got < raw.size()) {
    const ssize_t n = getrandom(raw.data() + got, raw.size() - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      std::fprintf(stderr, "getrandom: %s\n", std::strerror(errno));
      std::abort();  // no kernel randomness: never hand out a guessable id
    }
  }
  static const char* const kHex = "0123456789abcdef";
  std::string id;
  id.reserve(2 * raw.size());
  for (const unsigned char b : raw) {
    id += kHex[b >> 4];
    id += kHex[b & 15];
  }
  return id;
}

}  // namespace logprob
