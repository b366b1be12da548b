// absl::Status <-> grpc::Status (the codes are the same numbers).
#pragma once

#include <grpcpp/support/status.h>

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"

namespace logprob {

/// The most bytes of a status message sent (gRPC sends it in a trailer;
/// clients refuse trailers over 8 KiB with RESOURCE_EXHAUSTED, a code they
/// retry, so an error echoing a long name would hide its own code).
inline constexpr size_t kMaxGrpcMessageBytes = 2048;

/// `s` as a grpc::Status; a message over kMaxGrpcMessageBytes is cut
/// ("...(message cut, N bytes)").
inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string message(s.message());
  if (message.size() > kMaxGrpcMessageBytes)
    message =
        message.substr(0, kMaxGrpcMessageBytes) + "...(message cut, " + std::to_string(message.size()) + " bytes)";
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::move(message));
}

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace logprob
