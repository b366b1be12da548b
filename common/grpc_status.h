// absl::Status <-> grpc::Status (the codes are the same numbers), and the
// machine-readable reason (common/error_reason.h) that travels with a
// failed call as its trailing metadata kReasonMetadataKey: the public API
// (server/transport/scoring_service.cc) and the worker protocol (worker -> front-end)
// both send it this way.
#pragma once

#include <grpcpp/client_context.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "common/error_reason.h"
#include "common/untrusted_text.h"

namespace logprob {

/// The most bytes of a status message sent (gRPC sends it in a trailer;
/// clients refuse trailers over 8 KiB with RESOURCE_EXHAUSTED, a code they
/// retry, so an error echoing a long name would hide its own code).
inline constexpr size_t kMaxGrpcMessageBytes = 2048;

/// `s` as a grpc::Status; its control bytes escaped (EscapeControlBytes:
/// no raw newline, ESC or NUL reaches a client), and a message over
/// kMaxGrpcMessageBytes cut ("...(message cut, N bytes)").
inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string message = EscapeControlBytes(s.message());
  if (message.size() > kMaxGrpcMessageBytes)
    message =
        message.substr(0, kMaxGrpcMessageBytes) + "...(message cut, " + std::to_string(message.size()) + " bytes)";
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::move(message));
}

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

/// `s` as a grpc::Status (ToGrpc) for a server's reply on `ctx`, its
/// reason (ReasonOf), when it has one, added to the call's trailing
/// metadata kReasonMetadataKey (the enum value's name). Call it once per
/// reply, from the handler's thread.
inline grpc::Status ReplyWithReason(grpc::ServerContext* ctx, const absl::Status& s) {
  const v1::ErrorReason reason = ReasonOf(s);
  if (!s.ok() && reason != v1::ERROR_REASON_UNSPECIFIED)
    ctx->AddTrailingMetadata(kReasonMetadataKey, v1::ErrorReason_Name(reason));
  return ToGrpc(s);
}

/// The reason the server sent with a finished call on `ctx` (its trailing
/// metadata kReasonMetadataKey), or ERROR_REASON_UNSPECIFIED (none, or a
/// name this build does not know). Read it after the call returned.
inline v1::ErrorReason SentReason(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerTrailingMetadata();
  const auto it = md.find(kReasonMetadataKey);
  v1::ErrorReason reason = v1::ERROR_REASON_UNSPECIFIED;
  if (it != md.end()) v1::ErrorReason_Parse(std::string(it->second.data(), it->second.size()), &reason);
  return reason;
}

}  // namespace logprob
