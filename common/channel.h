// gRPC channels to a front-end (target grammar, TLS, bearer token): used by
// logprob-client and by the server to reach its peers (lm_head peer sync).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"

namespace logprob::client {

/// `target` when it is a gRPC target logprob-client can dial: "HOST:PORT"
/// ("[V6]:PORT" for IPv6), or a gRPC resolver URI ("unix:/path",
/// "dns:///HOST:PORT", "ipv4:", "ipv6:", "unix-abstract:", "vsock:"),
/// surrounding whitespace removed. The same rules and wording as the Python
/// client's `channel.check_target`, with `flag` ("--server") in place of
/// "target". Errors (INVALID_ARGUMENT saying what to change): empty, a URL
/// scheme ("http://HOST:PORT"; for https/grpcs also that TLS comes from
/// --tls-ca), no port, an IPv6 address without brackets, a port outside
/// 1..65535, no host. Pure string check; thread-safe.
absl::StatusOr<std::string> CheckTarget(const std::string& target, const std::string& flag = "--server");

/// An insecure channel to `target` ("HOST:PORT") whose send and receive
/// message size limits are INT_MAX (so they never undercut the server's
/// max_request_bytes; requests are split to that limit beforehand), and
/// whose reconnect backoff is short (100-500 ms) so a server that comes up
/// is noticed quickly by `health --wait`.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target);

/// Transport security and authentication of a channel (file names as the
/// command-line flags give them; all empty: MakeChannel(target)).
struct ChannelOptions {
  std::string tls_ca;           // --tls-ca: PEM CA that signs the server's certificate; implies TLS
  std::string tls_cert;         // --tls-cert: PEM client certificate chain (mutual TLS)
  std::string tls_key;          // --tls-key: its PEM private key
  std::string tls_server_name;  // --tls-server-name: name to verify instead of the target's host
  std::string auth_token_file;  // --auth-token-file: sends "authorization: Bearer TOKEN" on every call
  /// --update-token-file (update-lm-head, heads): the server's update token,
  /// sent instead of auth_token_file's (it may also score and read info).
  std::string update_token_file;
};

/// True when `options` asks for TLS (any of tls_ca, tls_cert, tls_key,
/// tls_server_name).
bool UsesTls(const ChannelOptions& options);

/// A channel like MakeChannel(target) with `options`: TLS verifying the
/// server with tls_ca (mutual TLS when tls_cert and tls_key are given), and
/// an interceptor adding the bearer token read from update_token_file, else
/// auth_token_file (whitespace around it trimmed) to every call's metadata. With
/// tls_cert/tls_key/tls_server_name but no tls_ca, the server is verified
/// against the system's roots. Errors (INVALID_ARGUMENT naming the flag and
/// file): a file that cannot be read or is empty; only one of tls_cert and
/// tls_key.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& target, const ChannelOptions& options);

}  // namespace logprob::client
