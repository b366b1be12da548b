// Machine-readable error reasons (logprob.v1.ErrorReason): attached to an
// absl::Status where the error is made, sent by the gRPC adapter as the
// trailing metadata kReasonMetadataKey (unary and chunked calls) or in
// ScoreResponse.status_reason (ScoreStream), read by the clients.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob {

/// Trailing metadata key of a failed call's reason (its enum value's name).
inline constexpr char kReasonMetadataKey[] = "logprob-error-reason";

/// `status` with `reason` attached (an absl::Status payload, which
/// survives LOGPROB_RETURN_IF_ERROR). OK statuses are returned unchanged.
absl::Status WithReason(absl::Status status, v1::ErrorReason reason);

/// The reason attached to `status`, or ERROR_REASON_UNSPECIFIED.
v1::ErrorReason ReasonOf(const absl::Status& status);

/// `status` with its message prefixed ("PREFIX: MESSAGE"), its code and
/// reason kept: an error passed on with where it happened. OK is returned
/// unchanged.
absl::Status Prefixed(const absl::Status& status, absl::string_view prefix);

}  // namespace logprob
