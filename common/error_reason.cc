#include "common/error_reason.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace logprob {
namespace {

constexpr char kPayloadUrl[] = "type.googleapis.com/logprob.v1.ErrorReason";

}  // namespace

absl::Status WithReason(absl::Status status, v1::ErrorReason reason) {
  if (!status.ok()) status.SetPayload(kPayloadUrl, absl::Cord(v1::ErrorReason_Name(reason)));
  return status;
}

v1::ErrorReason ReasonOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kPayloadUrl);
  v1::ErrorReason reason = v1::ERROR_REASON_UNSPECIFIED;
  if (payload) v1::ErrorReason_Parse(std::string(*payload), &reason);
  return reason;
}

absl::Status Prefixed(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  return WithReason(absl::Status(status.code(), absl::StrCat(prefix, ": ", status.message())), ReasonOf(status));
}

}  // namespace logprob
