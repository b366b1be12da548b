#include "server/heads/lm_head_update_calls.h"

namespace logprob {

absl::StatusOr<v1::LmHeadUpdate> InProcessLmHeadUpdateCalls::Begin(const v1::BeginLmHeadUpdateRequest& request) {
  return updates_.Begin(request);
}

absl::StatusOr<v1::LmHeadUpdate> InProcessLmHeadUpdateCalls::Put(const std::string& update_id,
                                                                 const v1::BeginLmHeadUpdateRequest& begin,
                                                                 int64_t row_begin, int64_t row_end,
                                                                 const LmHeadRowSource& rows) {
  v1::LmHeadRows put;
  put.set_update_id(update_id);
  put.set_row_begin(row_begin);
  put.mutable_rows()->set_name("lm_head.weight");
  put.mutable_rows()->set_dtype(begin.dtype());
  put.mutable_rows()->add_shape(row_end - row_begin);
  put.mutable_rows()->add_shape(begin.hidden_size());
  LmHeadPutIo io;
  io.cancel = rows.cancel;
  io.follow = [&](char* dst, const std::function<void(int64_t)>& progressed) {
    return rows.read(row_begin, row_end, dst, progressed);
  };
  return updates_.Put(put, io);
}

absl::StatusOr<v1::LmHeadInfo> InProcessLmHeadUpdateCalls::Commit(const std::string& update_id) {
  return updates_.Commit(update_id);
}

absl::Status InProcessLmHeadUpdateCalls::Abort(const std::string& update_id) {
  return updates_.Abort(update_id).status();
}

}  // namespace logprob
