// The public side of the lm_head gradient steps (docs/gradients.md): a
// step's dL/dW and dL/db sums live on the workers, each its vocabulary
// slice SplitRange(V, W, rank) (worker/gradients/head_gradient_steps.h);
// reading rows [a, b) asks each worker whose slice meets them for pieces
// of at most a few MiB, in row order, and a close reaches every worker.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.pb.h"
#include "logprob/v1/logprob.pb.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// How the core reaches the workers' steps (WorkerPool in the server).
struct GradientStepWorkers {
  int size = 0;
  /// One piece of rank `rank`'s slice sums (Worker.ReadHeadGradients).
  std::function<absl::StatusOr<v1::HeadGradientsChunk>(int rank, const internal::v1::WorkerHeadGradientsRequest&)> read;
  /// Closes the step on every worker (Worker.CloseHeadGradientStep).
  std::function<absl::Status(const std::string& step)> close;
};

/// Default and largest piece of ReadHeadGradients, bytes.
constexpr int64_t kDefaultGradientPieceBytes = int64_t{4} << 20;
constexpr int64_t kMaxGradientPieceBytes = int64_t{64} << 20;

/// Streams rows [row_begin, row_end) of `req`'s step to `write` (false:
/// the caller went; CANCELLED), each piece's rows in one
/// v1::HeadGradientsChunk with global row_begin and the head's V; the
/// first piece carries what the step covers. Errors: INVALID_ARGUMENT for
/// an empty or malformed step key, rows outside [0, V], a piece size over
/// kMaxGradientPieceBytes or a head other than the step's; NOT_FOUND for
/// an unknown head; the workers' errors (NOT_FOUND: no backward added to
/// the step; ALREADY_EXISTS: closed; FAILED_PRECONDITION: dropped).
/// Thread-safe.
absl::Status ReadHeadGradients(const LmHeads& heads, const GradientStepWorkers& workers,
                               const v1::ReadHeadGradientsRequest& req,
                               const std::function<bool(const v1::HeadGradientsChunk&)>& write);

/// Closes `req`'s step on every worker (idempotent). INVALID_ARGUMENT for a
/// malformed key; the workers' errors.
absl::Status CloseHeadGradientStep(const GradientStepWorkers& workers, const v1::CloseHeadGradientStepRequest& req);

/// A gradient step key: 1..128 characters of [A-Za-z0-9._:/+-].
bool ValidGradientStepKey(const std::string& key);
/// OK for a valid key, else INVALID_ARGUMENT "`field` must be 1..128
/// characters of [A-Za-z0-9._:/+-]" (the rule's one message).
absl::Status CheckGradientStepKey(const std::string& key, const std::string& field);

}  // namespace logprob
