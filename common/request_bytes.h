// The size a client announces for a unary request before sending it, so
// that the server can admit (or refuse) the request before reading its
// body: call metadata `logprob-request-bytes: N`, N the serialized
// request's bytes in decimal (proto/logprob/v1/logprob.proto, Score).
#pragma once

namespace logprob {

/// The metadata key of a unary Score request's announced size.
inline constexpr char kRequestBytesMetadataKey[] = "logprob-request-bytes";

}  // namespace logprob
