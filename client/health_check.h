// Client of the standard grpc.health.v1.Health service, called through a
// generic stub (no generated health code ships with Debian's gRPC).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/channel.h"

namespace logprob::client {

/// grpc.health.v1.HealthCheckResponse.ServingStatus values.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };

/// Name of a serving status ("SERVING", "NOT_SERVING", ...).
std::string ServingStatusName(ServingStatus status);

/// Decodes a serialized HealthCheckResponse: field 1 (varint) is the
/// status, absent means UNKNOWN; other fields are skipped.
/// INVALID_ARGUMENT on malformed protobuf bytes.
absl::StatusOr<ServingStatus> ParseHealthCheckResponse(const std::string& bytes);

/// One Health/Check call for the whole server (service "") on `channel`,
/// failing after `deadline`. Returns the reported status, or the call's
/// error (e.g. UNAVAILABLE when nothing listens, DEADLINE_EXCEEDED).
absl::StatusOr<ServingStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                          std::chrono::system_clock::time_point deadline);

/// Calls CheckHealth every ~200 ms until the server reports SERVING or
/// `wait` has passed (wait <= 0: one try, with a short deadline). OK once
/// SERVING; otherwise UNAVAILABLE naming the last status or error.
absl::Status WaitForServing(const std::shared_ptr<grpc::Channel>& channel, std::chrono::milliseconds wait);

}  // namespace logprob::client
