#include "server/parsed_requests.h"

#include "grpcpp/support/proto_buffer_reader.h"

namespace logprob {

grpc::Status ParseRequest(RawMessage* raw, google::protobuf::Message* msg, const char* method,
                          const std::string& what) {
  bool ok = false;
  {
    grpc::ProtoBufferReader reader(&raw->buffer);
    ok = reader.status().ok() && msg->ParseFromZeroCopyStream(&reader);
  }
  raw->buffer.Clear();
  if (ok) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      std::string(method) + ": " + what + " is not a valid " + msg->GetTypeName() +
                          " message (protobuf parse failed)");
}

}  // namespace logprob
