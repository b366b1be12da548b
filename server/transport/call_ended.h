// Whether a streaming call whose reads stopped was ended by the client.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <thread>

namespace logprob {

/// After a server stream's Read returned false: true when the call was
/// cancelled (client cancel, deadline, connection lost), false when the
/// client only closed its side early. gRPC can fail the Read a moment
/// before ServerContext::IsCancelled turns true, so this polls it for up
/// to `grace` (1 s): the price is paid only by a client that half-closes a
/// stream it has not finished, which then gets INVALID_ARGUMENT a second
/// later. Thread-safe (ServerContext::IsCancelled is, for the sync API).
inline bool CallEnded(grpc::ServerContext* context, std::chrono::milliseconds grace = std::chrono::seconds(1)) {
  const auto until = std::chrono::steady_clock::now() + grace;
  while (!context->IsCancelled()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace logprob
