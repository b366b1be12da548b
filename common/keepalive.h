// How fast the front-end and the workers notice a peer that stopped
// answering (a host gone, a link cut): HTTP/2 keepalive pings on every
// internal connection (the workers' Join streams to the control plane, the
// front-end's calls to the workers' Worker services), in both directions.
//
// A ping goes out every kKeepaliveTimeMs, with or without calls in flight;
// one not answered within kKeepaliveTimeoutMs closes the connection, which
// fails its calls with UNAVAILABLE: the front-end then fails the
// generation (the requests in flight get UNAVAILABLE, health goes
// NOT_SERVING) and the workers re-join. Worst case from the loss to the
// failure: kKeepaliveTimeMs + kKeepaliveTimeoutMs = 3.5 s, under the 5 s
// the issue asks for. A process that pauses for less than
// kKeepaliveTimeoutMs (a stall of a second or two: swapping, a stop, a
// long page-fault storm) answers its pings late but in time and stays.
// Pings are answered by gRPC's own threads, so a worker busy computing
// still answers them. Peers must accept pings this often: servers set a
// minimum interval below kKeepaliveTimeMs and no ping-strike limit
// (gRPC's default, 5 minutes and 2 strikes, would close the connection
// with "too_many_pings"). docs/architecture.md ("Supervision").
#pragma once

#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace logprob {

inline constexpr int kKeepaliveTimeMs = 1000;
inline constexpr int kKeepaliveTimeoutMs = 2500;

/// Keepalive for a channel (the caller's side of a connection).
inline void SetKeepalive(grpc::ChannelArguments& args) {
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // no cap on pings while no data flows
}

/// Keepalive for a server's connections, and permission for its clients
/// to ping at kKeepaliveTimeMs.
inline void SetKeepalive(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kKeepaliveTimeMs / 2);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

}  // namespace logprob
