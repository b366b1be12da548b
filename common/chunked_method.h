// Serving ScoreChunked with gRPC's sync server through the raw part codec
// of common/chunk_codec.h instead of protobuf messages.
#pragma once

#include "common/chunk_codec.h"
#include "grpcpp/support/method_handler.h"
#include "grpcpp/support/sync_stream.h"

namespace logprob::chunked {

/// The server stream of ScoreChunked as the codec sees it.
using ServerStream = grpc::ServerReaderWriter<OutgoingPart, IncomingPart>;

/// Index of ScoreChunked among the methods of the generated
/// v1::LogprobService::Service (its order in proto/logprob/v1/logprob.proto).
inline constexpr int kScoreChunkedMethodIndex = 3;

/// A sync handler calling `impl->ServeChunked(context, stream)`. A class
/// derived from v1::LogprobService::Service installs it in its constructor
/// with `MarkMethodStreamed(kScoreChunkedMethodIndex, NewChunkedHandler(this))`
/// (gRPC owns the handler).
template <class Impl>
grpc::internal::MethodHandler* NewChunkedHandler(Impl* impl) {
  return new grpc::internal::BidiStreamingHandler<Impl, IncomingPart, OutgoingPart>(
      [](Impl* s, grpc::ServerContext* context, ServerStream* stream) { return s->ServeChunked(context, stream); },
      impl);
}

}  // namespace logprob::chunked
