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

/// True for a call's peer on this host, as gRPC's ServerContext::peer()
/// spells it: "unix:...", "ipv4:127.*", "ipv6:[::1]" (or "%5B::1%5D") and
/// "ipv6:[::ffff:127.*]". Pure.
inline bool IsLocalPeer(std::string_view peer) {
  const auto starts = [peer](std::string_view p) { return peer.substr(0, p.size()) == p; };
  return starts("unix:") || starts("ipv4:127.") || starts("ipv6:[::1]") || starts("ipv6:[::ffff:127.") ||
         starts("ipv6:%5B::1%5D");
}

}  // namespace logprob
