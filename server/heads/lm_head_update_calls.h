// The update core (LmHeadUpdates) as the update driver's calls
// (common/lm_head_update_driver.h), for a driver in the front-end's own
// process: peer sync (server/transport/lm_head_peer_sync.h).
#pragma once

#include <string>

#include "common/lm_head_update_driver.h"
#include "server/heads/lm_head_updates.h"

namespace logprob {

/// LmHeadUpdateCalls on `updates` (not owned; outlives this). A put's rows
/// are read straight into the staged file (LmHeadPutIo::follow), with the
/// source's cancel as the put's. Thread-safe as LmHeadUpdates is.
class InProcessLmHeadUpdateCalls : public LmHeadUpdateCalls {
 public:
  explicit InProcessLmHeadUpdateCalls(LmHeadUpdates& updates) : updates_(updates) {}

  absl::StatusOr<v1::LmHeadUpdate> Begin(const v1::BeginLmHeadUpdateRequest& request) override;
  absl::StatusOr<v1::LmHeadUpdate> Put(const std::string& update_id, const v1::BeginLmHeadUpdateRequest& begin,
                                       int64_t row_begin, int64_t row_end, const LmHeadRowSource& rows) override;
  absl::StatusOr<v1::LmHeadInfo> Commit(const std::string& update_id) override;
  absl::Status Abort(const std::string& update_id) override;

 private:
  LmHeadUpdates& updates_;
};

}  // namespace logprob
