#include "common/lm_head_update_grpc.h"

#include <grpcpp/client_context.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/chunk_assembler.h"
#include "common/dtype.h"
#include "common/grpc_status.h"

namespace logprob {

GrpcLmHeadUpdateCalls::GrpcLmHeadUpdateCalls(std::shared_ptr<grpc::Channel> channel, std::chrono::milliseconds timeout,
                                             int64_t piece_bytes)
    : channel_(std::move(channel)),
      stub_(v1::LogprobService::NewStub(channel_)),
      timeout_(timeout),
      piece_bytes_(std::max<int64_t>(1, piece_bytes)) {}

void GrpcLmHeadUpdateCalls::Deadline(grpc::ClientContext* context) const {
  if (timeout_.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout_);
}

absl::StatusOr<v1::LmHeadUpdate> GrpcLmHeadUpdateCalls::Begin(const v1::BeginLmHeadUpdateRequest& request) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::LmHeadUpdate update;
  if (grpc::Status s = stub_->BeginLmHeadUpdate(&ctx, request, &update); !s.ok()) return FromGrpc(s);
  return update;
}

absl::StatusOr<v1::LmHeadUpdate> GrpcLmHeadUpdateCalls::Put(const std::string& update_id,
                                                            const v1::BeginLmHeadUpdateRequest& begin,
                                                            int64_t row_begin, int64_t row_end,
                                                            const LmHeadRowSource& rows) {
  const int64_t row_bytes = begin.hidden_size() * static_cast<int64_t>(DTypeSize(begin.dtype()));
  buffer_.resize(static_cast<size_t>((row_end - row_begin) * row_bytes));
  if (absl::Status st = rows.read(row_begin, row_end, buffer_.data(), {}); !st.ok()) return st;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::LmHeadUpdate progress;
  // PutLmHeadRows' parts have ScoreChunked's layout (LmHeadRowsPart: field
  // 1 the message, field 2 a TensorPiece): written by the chunk codec.
  static const std::string kMethod = absl::StrCat("/", v1::LogprobService::service_full_name(), "/PutLmHeadRows");
  const grpc::internal::RpcMethod method(kMethod.c_str(), grpc::internal::RpcMethod::CLIENT_STREAMING, channel_);
  std::unique_ptr<grpc::ClientWriter<chunked::OutgoingPart>> writer(
      grpc::internal::ClientWriterFactory<chunked::OutgoingPart>::Create(channel_.get(), method, &ctx, &progress));
  v1::LmHeadRowsPart first;
  v1::LmHeadRows* head = first.mutable_rows();
  head->set_update_id(update_id);
  head->set_row_begin(row_begin);
  v1::Tensor* t = head->mutable_rows();
  t->set_name("rows");
  t->set_dtype(begin.dtype());
  t->add_shape(row_end - row_begin);
  t->add_shape(begin.hidden_size());
  chunked::OutgoingPart part;
  part.message = &first;
  // A failed write means the server ended the call: Finish says why.
  if (writer->Write(part) && chunked::WritePieces([&](const chunked::OutgoingPart& p) { return writer->Write(p); }, {0},
                                                  {std::string_view(buffer_.data(), buffer_.size())}, piece_bytes_))
    writer->WritesDone();
  if (grpc::Status s = writer->Finish(); !s.ok()) return FromGrpc(s);
  return progress;
}

absl::StatusOr<v1::LmHeadInfo> GrpcLmHeadUpdateCalls::Commit(const std::string& update_id) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::LmHeadUpdateRef ref;
  ref.set_update_id(update_id);
  v1::LmHeadInfo committed;
  if (grpc::Status s = stub_->CommitLmHeadUpdate(&ctx, ref, &committed); !s.ok()) return FromGrpc(s);
  return committed;
}

absl::Status GrpcLmHeadUpdateCalls::Abort(const std::string& update_id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::LmHeadUpdateRef ref;
  ref.set_update_id(update_id);
  v1::LmHeadUpdate ignored;
  return FromGrpc(stub_->AbortLmHeadUpdate(&ctx, ref, &ignored));
}

}  // namespace logprob
