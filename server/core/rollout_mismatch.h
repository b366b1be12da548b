// The rollout engine's logprobs against the service's: per-token log-ratios
// and truncated importance weights, per-sequence and per-request mismatch
// estimators (docs/SPEC.md "Rollout mismatch"; docs/rl-frameworks.md
// "Rollout vs trainer mismatch").
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob {

/// A request's rollout logprobs (input "rollout_logprobs", F32, shaped like
/// token_logprobs) and the options that read them. Immutable once built.
struct RolloutInput {
  /// One value per output position [num_outputs]; NaN: the rollout has none.
  std::vector<float> logprobs;
  /// Output offsets of the sequences [B + 1]: sequence s owns the output
  /// positions [seq_out[s], seq_out[s + 1]).
  std::vector<int64_t> seq_out;
  double ratio_cap = 3.0;  // min(r, cap); +inf: no truncation
  double band_low = 0.9;   // r outside [band_low, band_high] is counted
  double band_high = 1.1;
};

/// Reads the rollout options of `options` (ScoreOptions.rollout_ratio_cap,
/// rollout_band_low, rollout_band_high; defaults 3, 0.9, 1.1) into `out`.
/// INVALID_ARGUMENT naming the field: a cap that is NaN or <= 0, a band
/// with low < 0, NaN ends, or low >= high. Pure.
absl::Status ParseRolloutOptions(const v1::ScoreOptions& options, RolloutInput* out);

/// Clears the rollout fields of `options` (they change the response only,
/// never what the workers compute, so requests that differ in them still
/// share a batch).
void ClearRolloutOptions(v1::ScoreOptions* options);

/// Checks the rollout logprob at output position `out` of a scored, not
/// ignored token (sequence `seq`, output position `position` within it, as
/// for gather_indices): NaN (none),
/// -inf or a finite value <= 0. INVALID_ARGUMENT naming the sequence and
/// position otherwise (> 0 or +inf is not a log-probability).
absl::Status CheckRolloutLogprob(float value, int64_t seq, int64_t position);

/// Sums of one set of compared tokens (a sequence or the request), in
/// float64. A compared token has a service logprob and a rollout logprob
/// that are not both -inf, and a rollout logprob that is not NaN.
struct MismatchSums {
  int64_t tokens = 0;
  double abs_log_ratio = 0;  // sum |l|
  double log_ratio = 0;      // sum l
  double k3 = 0;             // sum (r - 1 - l)
  int64_t outside_band = 0;  // tokens with r < band_low or r > band_high

  /// Adds one token of log-ratio l = logp_service - logp_rollout (may be
  /// +-inf; k3's term is then +inf, its limit).
  void Add(double l, const RolloutInput& in);
};

/// The log-ratio l = logp_service - logp_rollout of one token in float64,
/// or NaN when it is not compared (rollout NaN, or both -inf).
double RolloutLogRatio(float service_logprob, float rollout_logprob);

/// What the metrics record of one request (Metrics::ObserveRolloutMismatch).
struct RolloutObservation {
  std::vector<float> log_ratios;  // l of each compared token, in output order (may be +-inf)
  int64_t outside_band = 0;       // compared tokens with r outside the band
  double k3 = 0;                  // the request's mean (NaN without compared tokens)
};

/// Adds the mismatch outputs to `resp`, which holds `token_logprobs`
/// [out_shape] (BuildResponse): per token `rollout_log_ratio` l and
/// `rollout_ratio` min(exp(l), cap) (F32 [out_shape], NaN where not
/// compared); per sequence (F32 [B] unless noted) `rollout_seq_tokens` (I64),
/// `rollout_seq_mean_abs_log_ratio`, `rollout_seq_k1` mean(-l),
/// `rollout_seq_k3` mean(r - 1 - l), `rollout_seq_outside_band` (fraction),
/// `rollout_seq_ratio` min(prod r, cap) and `rollout_seq_geo_ratio`
/// min(exp(mean l), cap) (NaN for a sequence without compared tokens); and
/// ScoreResponse.rollout_mismatch over all compared tokens of the request.
/// `scored[o]` (size num_outputs) is false for output positions that were
/// not scored (padding) or whose target is ignore_index: never compared. INTERNAL when token_logprobs is missing
/// or sized wrongly. Returns what the metrics record. Pure; reads only its
/// arguments.
absl::StatusOr<RolloutObservation> AddRolloutMismatch(const RolloutInput& in, const std::vector<bool>& scored,
                                                      v1::ScoreResponse* resp);

}  // namespace logprob
