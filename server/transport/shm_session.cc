#include "server/transport/shm_session.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/loopback.h"
#include "common/sha256.h"

namespace logprob {
namespace {

std::string Metadata(const grpc::ServerContext& context, const char* key) {
  const auto& md = context.client_metadata();
  auto it = md.find(key);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

/// The peer without its port: "ipv4:127.0.0.1", "ipv6:[::1]", "unix".
std::string PeerHost(const std::string& peer) {
  if (absl::StartsWith(peer, "unix:")) return "unix";
  const size_t colon = peer.rfind(':');
  if (colon == std::string::npos || peer.find(':') == colon) return peer;
  return peer.substr(0, colon);
}

}  // namespace

absl::StatusOr<std::string> SharedMemoryOwner(const grpc::ServerContext& context) {
  const std::string peer = context.peer();
  if (!IsLocalPeer(peer))
    return absl::PermissionDeniedError(
        absl::StrCat("shared-memory inputs are for clients on the server's host; peer ", peer, " is not local"));
  const std::string session = Metadata(context, kShmSessionMetadata);
  bool ok = session.size() >= 16 && session.size() <= 128;
  for (char c : session)
    ok &= (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  if (!ok)
    return absl::InvalidArgumentError(absl::StrCat("shared-memory calls need the metadata \"", kShmSessionMetadata,
                                                   "\": 16..128 of [A-Za-z0-9_-] (a random key of the client)"));
  const std::string key = absl::StrCat(session, "\n", PeerHost(peer), "\n", Metadata(context, "authorization"));
  return Sha256Hex(key);
}

}  // namespace logprob
