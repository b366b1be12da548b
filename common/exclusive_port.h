// Listening ports that refuse to be shared.
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>

namespace logprob {

/// Makes every port `builder` listens on exclusive: gRPC sets SO_REUSEPORT
/// by default, so a second process binding a busy port would start anyway
/// and take part of its connections (e.g. a leftover server without the
/// right lm_head). With it off, BuildAndStart fails on a busy port.
inline void ExclusivePorts(grpc::ServerBuilder& builder) { builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0); }

/// The error text for a port that could not be bound.
inline std::string CannotListen(const std::string& what, const std::string& address) {
  return "cannot listen on " + what + " " + address +
         ": the port is in use (another process listens there: `ss -ltnp` names it) or the address is not "
         "this machine's";
}

}  // namespace logprob
