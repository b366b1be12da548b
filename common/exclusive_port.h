// Listening ports that refuse to be shared (docs/security.md).
//
// gRPC's server builder sets SO_REUSEPORT on its listening sockets by
// default: a second process (same uid) bound to a busy port then starts
// normally and the kernel spreads new connections over both, so a leftover
// server silently takes part of the traffic. Every port the server and
// the workers listen on goes through ExclusivePorts, so the second bind
// fails (EADDRINUSE) and the process exits naming the port and its holder
// (ListenFailure). The metrics exporter (prometheus-cpp / civetweb) binds
// with SO_REUSEADDR only, which Linux never lets two listeners share.
#pragma once

#include <map>
#include <string>

#include "grpcpp/server_builder.h"

namespace logprob {

/// Turns SO_REUSEPORT off for `builder`'s listening ports
/// (GRPC_ARG_ALLOW_REUSEPORT = 0).
void ExclusivePorts(grpc::ServerBuilder& builder);

/// This network namespace's TCP sockets in LISTEN state (/proc/net/tcp and
/// tcp6): socket inode (as in /proc/PID/fd's "socket:[INODE]") -> port.
std::map<std::string, int> ListeningTcpSockets();

/// Why `address` ("host:port", "[v6]:port") cannot be listened on, for
/// the message of a process that failed to: e.g. "127.0.0.1:5000 is
/// already in use (by pid 4242, logprob-server)", from a test bind(2) with
/// SO_REUSEADDR and, when the port is busy, the listening sockets in
/// /proc/net/tcp{,6} matched to the processes' descriptors (those this
/// process may inspect; "by another process" otherwise). Falls back to the
/// bind's error text; says so when the address binds now (a race, or
/// something else failed).
std::string ListenFailure(const std::string& address);

}  // namespace logprob
