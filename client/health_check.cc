#include "client/health_check.h"

#include <future>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace logprob::client {
namespace {

constexpr char kCheckMethod[] = "/grpc.health.v1.Health/Check";
// Deadline of one try when there is no --wait (and at least this long per
// try otherwise), so a hung server does not block forever.
constexpr std::chrono::milliseconds kMinTryDeadline{2000};
constexpr std::chrono::milliseconds kRetryInterval{200};

// Reads a base-128 varint at bytes[*pos]; false when truncated or too long.
bool ReadVarint(const std::string& bytes, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*pos >= bytes.size()) return false;
    const uint8_t b = static_cast<uint8_t>(bytes[(*pos)++]);
    *value |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) return true;
  }
  return false;
}

}  // namespace

std::string ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kUnknown:
      return "UNKNOWN";
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
  }
  return absl::StrCat("status ", static_cast<int>(status));
}

absl::StatusOr<ServingStatus> ParseHealthCheckResponse(const std::string& bytes) {
  ServingStatus status = ServingStatus::kUnknown;
  size_t pos = 0;
  const absl::Status malformed = absl::InvalidArgumentError("malformed grpc.health.v1.HealthCheckResponse");
  while (pos < bytes.size()) {
    uint64_t tag = 0;
    if (!ReadVarint(bytes, &pos, &tag)) return malformed;
    const uint64_t field = tag >> 3;
    uint64_t value = 0;
    switch (tag & 7) {
      case 0:  // varint
        if (!ReadVarint(bytes, &pos, &value)) return malformed;
        if (field == 1) status = static_cast<ServingStatus>(static_cast<int>(value));
        break;
      case 1:  // fixed64
        if (bytes.size() - pos < 8) return malformed;
        pos += 8;
        break;
      case 2:  // length-delimited
        if (!ReadVarint(bytes, &pos, &value) || bytes.size() - pos < value) return malformed;
        pos += value;
        break;
      case 5:  // fixed32
        if (bytes.size() - pos < 4) return malformed;
        pos += 4;
        break;
      default:
        return malformed;
    }
  }
  return status;
}

absl::StatusOr<ServingStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                          std::chrono::system_clock::time_point deadline) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(deadline);
  // HealthCheckRequest{service: ""} serializes to zero bytes.
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, kCheckMethod, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) return FromGrpc(status);

  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) {
    return absl::InternalError("cannot read the health check response");
  }
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return ParseHealthCheckResponse(bytes);
}

absl::Status WaitForServing(const std::shared_ptr<grpc::Channel>& channel, std::chrono::milliseconds wait) {
  using Clock = std::chrono::system_clock;
  const Clock::time_point give_up = Clock::now() + wait;
  std::string last;
  for (int attempt = 1;; ++attempt) {
    const Clock::time_point deadline = std::max(give_up, Clock::now() + kMinTryDeadline);
    absl::StatusOr<ServingStatus> s = CheckHealth(channel, deadline);
    if (s.ok() && *s == ServingStatus::kServing) return absl::OkStatus();
    last = s.ok() ? absl::StrCat("server reports ", ServingStatusName(*s)) : s.status().ToString();
    const Clock::time_point now = Clock::now();
    if (now >= give_up) {
      return absl::UnavailableError(
          absl::StrCat("server not serving after ", attempt, attempt == 1 ? " try" : " tries", ": ", last));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(kRetryInterval, give_up - now));
  }
}

}  // namespace logprob::client
