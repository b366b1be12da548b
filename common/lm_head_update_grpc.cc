#include "common/lm_head_update_grpc.h"

#include <grpcpp/client_context.h>

#include <algorithm>

#include "common/dtype.h"
#include "common/grpc_status.h"

namespace logprob {

GrpcLmHeadUpdateCalls::GrpcLmHeadUpdateCalls(v1::LogprobService::StubInterface& stub, std::chrono::milliseconds timeout,
                                             int64_t piece_bytes)
    : stub_(stub), timeout_(timeout), piece_bytes_(std::max<int64_t>(1, piece_bytes)) {}

void GrpcLmHeadUpdateCalls::Deadline(grpc::ClientContext* context) const {
  if (timeout_.count() > 0) context->set_deadline(std::chrono::system_clock::now() + timeout_);
}

absl::StatusOr<v1::LmHeadUpdate> GrpcLmHeadUpdateCalls::Begin(const v1::BeginLmHeadUpdateRequest& request) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  v1::LmHeadUpdate update;
  if (grpc::Status s = stub_.BeginLmHeadUpdate(&ctx, request, &update); !s.ok()) return FromGrpc(s);
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
  auto writer = stub_.PutLmHeadRows(&ctx, &progress);
  v1::LmHeadRowsPart first;
  v1::LmHeadRows* head = first.mutable_rows();
  head->set_update_id(update_id);
  head->set_row_begin(row_begin);
  v1::Tensor* t = head->mutable_rows();
  t->set_name("rows");
  t->set_dtype(begin.dtype());
  t->add_shape(row_end - row_begin);
  t->add_shape(begin.hidden_size());
  bool ok = writer->Write(first);
  const size_t step = static_cast<size_t>(piece_bytes_);
  for (size_t off = 0; ok && off < buffer_.size(); off += step) {
    v1::LmHeadRowsPart piece;
    piece.mutable_piece()->set_offset(static_cast<int64_t>(off));
    piece.mutable_piece()->set_data(buffer_.data() + off, std::min(step, buffer_.size() - off));
    ok = writer->Write(piece);
  }
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
  if (grpc::Status s = stub_.CommitLmHeadUpdate(&ctx, ref, &committed); !s.ok()) return FromGrpc(s);
  return committed;
}

absl::Status GrpcLmHeadUpdateCalls::Abort(const std::string& update_id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::LmHeadUpdateRef ref;
  ref.set_update_id(update_id);
  v1::LmHeadUpdate ignored;
  return FromGrpc(stub_.AbortLmHeadUpdate(&ctx, ref, &ignored));
}

}  // namespace logprob
