#include "server/app/peer_sync_setup.h"

#include "common/channel.h"

namespace logprob {

PeerSyncOptions PeerSyncOptionsFromFlags(const ServerFlags& flags) {
  client::ChannelOptions peer_channel;
  peer_channel.auth_token_file = flags.auth_token_file;
  peer_channel.tls_ca = flags.lm_head_sync_tls_ca;
  if (!peer_channel.tls_ca.empty()) {
    peer_channel.tls_cert = flags.tls_cert;
    peer_channel.tls_key = flags.tls_key;
    peer_channel.tls_server_name = flags.lm_head_sync_tls_server_name;
  }
  PeerSyncOptions sync;
  sync.target = flags.lm_head_sync_from;
  sync.channel = [peer_channel](const std::string& address) { return client::MakeChannel(address, peer_channel); };
  sync.pull_timeout = std::chrono::seconds(absl::ToInt64Seconds(flags.lm_head_sync_timeout));
  return sync;
}

}  // namespace logprob
