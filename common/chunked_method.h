// Serving ScoreChunked with gRPC's sync server through the raw part codec
// of common/chunk_codec.h instead of protobuf messages.
#pragma once

#include "common/chunk_codec.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/method_handler.h"
#include "grpcpp/support/sync_stream.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob::chunked {

/// The server stream of ScoreChunked as the codec sees it.
using ServerStream = grpc::ServerReaderWriter<OutgoingPart, IncomingPart>;

/// Index of method `name` among the methods of the generated
/// v1::LogprobService::Service: the generated code registers the methods in
/// their order in proto/logprob/v1/logprob.proto, which the descriptor gives.
inline int MethodIndex(const char* name) {
  return google::protobuf::DescriptorPool::generated_pool()
      ->FindServiceByName(v1::LogprobService::service_full_name())
      ->FindMethodByName(name)
      ->index();
}

/// Index of ScoreChunked (MethodIndex).
inline int ScoreChunkedMethodIndex() {
  static const int index = MethodIndex("ScoreChunked");
  return index;
}

/// A sync handler calling `impl->ServeChunked(context, stream)`. A class
/// derived from v1::LogprobService::Service installs it in its constructor
/// with `MarkMethodStreamed(ScoreChunkedMethodIndex(), NewChunkedHandler(this))`
/// (gRPC owns the handler).
template <class Impl>
grpc::internal::MethodHandler* NewChunkedHandler(Impl* impl) {
  return new grpc::internal::BidiStreamingHandler<Impl, IncomingPart, OutgoingPart>(
      [](Impl* s, grpc::ServerContext* context, ServerStream* stream) { return s->ServeChunked(context, stream); },
      impl);
}

}  // namespace logprob::chunked
