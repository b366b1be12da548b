#include "tests/generic_call.h"

#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace logprob::testing {

grpc::Status GenericUnaryCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& path,
                              const std::string& request, std::chrono::milliseconds timeout) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::Slice slice(request);  // a buffer of one (maybe empty) slice: a valid message
  grpc::ByteBuffer req(&slice, 1);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, path, req, &cq);
  call->StartCall();
  grpc::ByteBuffer resp;
  grpc::Status st;
  call->Finish(&resp, &st, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return st;
}

}  // namespace logprob::testing
