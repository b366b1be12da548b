// Whether a host names this machine's loopback: the one rule the front-end
// and the workers use to decide whether an unauthenticated internal plane
// is reachable only from this host (docs/security.md "The internal plane").
#pragma once

#include <string_view>

namespace logprob {

/// True when `host` (a name or an address; IPv6 with or without brackets,
/// no port) is this machine's loopback: "localhost", 127.0.0.0/8 or ::1.
/// Pure.
inline bool IsLoopbackHost(std::string_view host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.substr(0, 4) == "127.";
}

}  // namespace logprob
