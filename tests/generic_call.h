// One unary gRPC call of any method by its path, with the request's bytes
// as they are (grpc::GenericStub): how the internal-plane tests call every
// method a proto declares without a typed stub per method.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/support/status.h"

namespace logprob::testing {

/// Calls `path` ("/package.Service/Method") on `channel` with the
/// serialized `request` (empty: the default message of any type) and waits
/// at most `timeout`; the call's status (the reply is dropped). A
/// server-streaming method is called the same way (one request, the
/// status at the end).
grpc::Status GenericUnaryCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& path,
                              const std::string& request, std::chrono::milliseconds timeout);

}  // namespace logprob::testing
