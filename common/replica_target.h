// The targets that name a deployment's front-ends: logprob-server
// --lm-head-sync-from (server/transport/lm_head_peer_sync.h) and the Python
// client's replicas (client/python/logprob_client/replicas.py) parse them
// with one grammar, written down with its cases in
// tests/data/replica_targets/targets.json (both are tested against it).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace logprob {

/// A target parsed: how its addresses are reached, and the addresses.
struct ReplicaTarget {
  enum class Kind {
    kListed,  // "ipv4:" / "ipv6:": the addresses as given
    kDns,     // "dns:" / "dns:///": every A/AAAA record of each HOST
    kPlain,   // HOST:PORT[,HOST:PORT...]: the reader decides (peer sync resolves them as kDns)
  };
  Kind kind = Kind::kPlain;
  /// "HOST:PORT" or "[IPV6]:PORT", duplicates removed, order kept; never empty.
  std::vector<std::string> addresses;
  /// The host and port of addresses[i].
  std::vector<std::pair<std::string, std::string>> host_ports;
};

/// Parses `target` (tests/data/replica_targets/targets.json "grammar").
/// INVALID_ARGUMENT naming `flag` and the part at fault: an address without
/// a host or a port, a port outside 1..65535, another scheme, no address.
/// Pure string work; thread-safe.
absl::StatusOr<ReplicaTarget> ParseReplicaTarget(const std::string& target, const std::string& flag);

}  // namespace logprob
