// A gRPC channel whose every call carries one fixed initial-metadata
// entry: the public client's bearer token (common/channel.cc) and the
// internal plane's pool secret (common/internal_auth.h) travel this way.
#pragma once

#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace logprob {

/// A channel to `target` over `creds` with `args` on which every call sends
/// the metadata `key: value` (added by a client interceptor, so it also
/// works over insecure credentials, where gRPC drops call credentials).
/// `key` must be lower-case ASCII; `value` printable ASCII. Thread-safe.
std::shared_ptr<grpc::Channel> ChannelWithMetadata(const std::string& target,
                                                   const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                                   const grpc::ChannelArguments& args, std::string key,
                                                   std::string value);

}  // namespace logprob
