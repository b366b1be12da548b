#include "common/lm_head_update_driver.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/random_id.h"

namespace logprob {
namespace {

/// `status` with its message prefixed by `step`.
absl::Status InStep(const std::string& step, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(step, ": ", status.message()));
}

/// `call()` tried up to `attempts` times while it ends UNAVAILABLE.
template <typename Call>
auto Tried(int attempts, std::chrono::milliseconds backoff, Call call) -> decltype(call()) {
  for (int attempt = 1;; ++attempt) {
    auto result = call();
    if (result.ok() || result.status().code() != absl::StatusCode::kUnavailable || attempt >= attempts) return result;
    std::this_thread::sleep_for(backoff);
    backoff *= 2;
  }
}

}  // namespace

absl::StatusOr<LmHeadUpdateOutcome> DriveLmHeadUpdate(LmHeadUpdateCalls& calls, v1::BeginLmHeadUpdateRequest begin,
                                                      const LmHeadRowSource& rows,
                                                      const LmHeadUpdateDriverOptions& options) {
  if (begin.client_token().empty()) begin.set_client_token(RandomId());
  const int attempts = std::max(1, options.attempts);
  absl::StatusOr<v1::LmHeadUpdate> opened = Tried(attempts, options.backoff, [&] { return calls.Begin(begin); });
  if (!opened.ok()) return InStep("BeginLmHeadUpdate", opened.status());
  LmHeadUpdateOutcome outcome;
  if (opened->already_committed()) {
    outcome.already_committed = true;
    return outcome;
  }
  const std::string id = opened->update_id();
  auto failed = [&](const absl::Status& status) {
    (void)calls.Abort(id);  // the update may have ended already (a failed commit aborts it)
    return status;
  };
  const int64_t V = begin.vocab_size();
  const int64_t row_bytes = begin.hidden_size() * static_cast<int64_t>(DTypeSize(begin.dtype()));
  const int64_t per_put = options.rows_per_put > 0
                              ? options.rows_per_put
                              : std::max<int64_t>(1, options.put_bytes / std::max<int64_t>(1, row_bytes));
  const int put_attempts = rows.rereadable ? attempts : 1;
  for (int64_t r0 = 0; r0 < V; r0 += per_put) {
    const int64_t r1 = std::min(V, r0 + per_put);
    absl::StatusOr<v1::LmHeadUpdate> put =
        Tried(put_attempts, options.backoff, [&] { return calls.Put(id, begin, r0, r1, rows); });
    if (!put.ok()) return failed(InStep(absl::StrCat("PutLmHeadRows rows [", r0, ", ", r1, ")"), put.status()));
    if (options.on_put) options.on_put(*put);
  }
  absl::StatusOr<v1::LmHeadInfo> committed = Tried(attempts, options.backoff, [&] { return calls.Commit(id); });
  if (!committed.ok()) return failed(InStep("CommitLmHeadUpdate", committed.status()));
  outcome.committed = *std::move(committed);
  return outcome;
}

}  // namespace logprob
