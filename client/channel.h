// Creating the client's gRPC channel to the front-end.
#pragma once

#include <memory>
#include <string>

#include "grpcpp/channel.h"

namespace logprob::client {

/// An insecure channel to `target` ("HOST:PORT") whose send and receive
/// message size limits are INT_MAX (so they never undercut the server's
/// max_request_bytes; requests are split to that limit beforehand), and
/// whose reconnect backoff is short (100-500 ms) so a server that comes up
/// is noticed quickly by `health --wait`.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target);

}  // namespace logprob::client
