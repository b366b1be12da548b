// The lm_head update protocol's calls over gRPC (LogprobService's
// BeginLmHeadUpdate, PutLmHeadRows, CommitLmHeadUpdate, AbortLmHeadUpdate),
// for DriveLmHeadUpdate (common/lm_head_update_driver.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/chunk_codec.h"
#include "common/lm_head_update_driver.h"
#include "grpcpp/channel.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob {

/// LmHeadUpdateCalls on `channel`. Each call has the deadline `timeout`
/// from its start (zero: none). A put reads its rows into one buffer,
/// reused by the next put, and sends them after its LmHeadRows part in
/// TensorPieces of `piece_bytes` written by the chunk codec
/// (chunked::WritePieces: the pieces view the buffer, no copies; the parts
/// share ScoreChunked's layout). Statuses are the server's. Not
/// thread-safe (one update at a time).
class GrpcLmHeadUpdateCalls : public LmHeadUpdateCalls {
 public:
  explicit GrpcLmHeadUpdateCalls(std::shared_ptr<grpc::Channel> channel,
                                 std::chrono::milliseconds timeout = std::chrono::milliseconds{0},
                                 int64_t piece_bytes = chunked::kDefaultPieceBytes);

  absl::StatusOr<v1::LmHeadUpdate> Begin(const v1::BeginLmHeadUpdateRequest& request) override;
  absl::StatusOr<v1::LmHeadUpdate> Put(const std::string& update_id, const v1::BeginLmHeadUpdateRequest& begin,
                                       int64_t row_begin, int64_t row_end, const LmHeadRowSource& rows) override;
  absl::StatusOr<v1::LmHeadInfo> Commit(const std::string& update_id) override;
  absl::Status Abort(const std::string& update_id) override;

 private:
  void Deadline(grpc::ClientContext* context) const;

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::LogprobService::Stub> stub_;
  const std::chrono::milliseconds timeout_;
  const int64_t piece_bytes_;
  std::vector<char> buffer_;  // the rows of the put in progress
};

}  // namespace logprob
