#include "server/core/rollout_mismatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/core/response_builder.h"

namespace logprob {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// min(x, cap), NaN for NaN x.
double Capped(double x, double cap) { return std::isnan(x) ? kNaN : std::min(x, cap); }

}  // namespace

absl::Status ParseRolloutOptions(const v1::ScoreOptions& options, RolloutInput* out) {
  if (options.has_rollout_ratio_cap()) out->ratio_cap = options.rollout_ratio_cap();
  if (options.has_rollout_band_low()) out->band_low = options.rollout_band_low();
  if (options.has_rollout_band_high()) out->band_high = options.rollout_band_high();
  if (!(out->ratio_cap > 0))
    return absl::InvalidArgumentError(
        absl::StrCat("options.rollout_ratio_cap must be > 0 (+inf: no truncation), got ", out->ratio_cap));
  if (!(out->band_low >= 0) || std::isnan(out->band_high) || !(out->band_low < out->band_high))
    return absl::InvalidArgumentError(absl::StrCat("options.rollout_band_low / rollout_band_high must satisfy 0 <= ",
                                                   "low < high, got [", out->band_low, ", ", out->band_high, "]"));
  return absl::OkStatus();
}

void ClearRolloutOptions(v1::ScoreOptions* options) {
  options->clear_rollout_ratio_cap();
  options->clear_rollout_band_low();
  options->clear_rollout_band_high();
}

absl::Status CheckRolloutLogprob(float value, int64_t seq, int64_t position) {
  if (std::isnan(value) || value <= 0.f) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("\"rollout_logprobs\": value ", value, " of sequence ", seq,
                                                 " at position ", position,
                                                 " is not a log-probability (expected <= 0, -inf, or NaN for none)"));
}

double RolloutLogRatio(float service_logprob, float rollout_logprob) {
  if (std::isnan(rollout_logprob) || std::isnan(service_logprob)) return kNaN;
  if (std::isinf(service_logprob) && std::isinf(rollout_logprob)) return kNaN;  // both -inf: nothing to compare
  return static_cast<double>(service_logprob) - static_cast<double>(rollout_logprob);
}

void MismatchSums::Add(double l, const RolloutInput& in) {
  ++tokens;
  abs_log_ratio += std::abs(l);
  log_ratio += l;
  const double r = std::exp(l);
  // r - 1 - l >= 0; its limit is +inf at l = +-inf (exp(l) - l would be inf - inf).
  k3 += std::isinf(l) ? std::numeric_limits<double>::infinity() : std::expm1(l) - l;
  if (r < in.band_low || r > in.band_high) ++outside_band;
}

absl::StatusOr<RolloutObservation> AddRolloutMismatch(const RolloutInput& in, const std::vector<bool>& scored,
                                                      v1::ScoreResponse* resp) {
  const v1::Tensor* lp_tensor = nullptr;
  for (const v1::Tensor& t : resp->outputs())
    if (t.name() == "token_logprobs") lp_tensor = &t;
  const size_t n = in.logprobs.size();
  if (lp_tensor == nullptr || lp_tensor->data().size() != n * sizeof(float) || scored.size() != n ||
      in.seq_out.empty() || in.seq_out.back() != static_cast<int64_t>(n))
    return absl::InternalError("rollout mismatch: token_logprobs does not match the rollout logprobs");
  const std::vector<int64_t> out_shape(lp_tensor->shape().begin(), lp_tensor->shape().end());
  std::vector<float> service(n);
  if (n) std::memcpy(service.data(), lp_tensor->data().data(), n * sizeof(float));

  const std::vector<int64_t> seq_shape = {static_cast<int64_t>(in.seq_out.size()) - 1};
  const size_t B = in.seq_out.size() - 1;
  float* log_ratio = AddOutput<float>(resp, "rollout_log_ratio", v1::F32, out_shape, -1, static_cast<int64_t>(n));
  float* ratio = AddOutput<float>(resp, "rollout_ratio", v1::F32, out_shape, -1, static_cast<int64_t>(n));
  int64_t* seq_tokens = AddOutput<int64_t>(resp, "rollout_seq_tokens", v1::I64, seq_shape, -1, static_cast<int64_t>(B));
  float* seq_abs =
      AddOutput<float>(resp, "rollout_seq_mean_abs_log_ratio", v1::F32, seq_shape, -1, static_cast<int64_t>(B));
  float* seq_k1 = AddOutput<float>(resp, "rollout_seq_k1", v1::F32, seq_shape, -1, static_cast<int64_t>(B));
  float* seq_k3 = AddOutput<float>(resp, "rollout_seq_k3", v1::F32, seq_shape, -1, static_cast<int64_t>(B));
  float* seq_band = AddOutput<float>(resp, "rollout_seq_outside_band", v1::F32, seq_shape, -1, static_cast<int64_t>(B));
  float* seq_ratio = AddOutput<float>(resp, "rollout_seq_ratio", v1::F32, seq_shape, -1, static_cast<int64_t>(B));
  float* seq_geo = AddOutput<float>(resp, "rollout_seq_geo_ratio", v1::F32, seq_shape, -1, static_cast<int64_t>(B));

  MismatchSums request;
  RolloutObservation seen;
  for (size_t s = 0; s < B; ++s) {
    MismatchSums seq;
    for (int64_t o = in.seq_out[s]; o < in.seq_out[s + 1]; ++o) {
      const double l = scored[o] ? RolloutLogRatio(service[o], in.logprobs[o]) : kNaN;
      log_ratio[o] = static_cast<float>(l);
      ratio[o] = static_cast<float>(Capped(std::exp(l), in.ratio_cap));
      if (std::isnan(l)) continue;
      seq.Add(l, in);
      request.Add(l, in);
      seen.log_ratios.push_back(log_ratio[o]);
    }
    const double k = static_cast<double>(seq.tokens);
    seq_tokens[s] = seq.tokens;
    seq_abs[s] = static_cast<float>(seq.tokens ? seq.abs_log_ratio / k : kNaN);
    seq_k1[s] = static_cast<float>(seq.tokens ? -seq.log_ratio / k : kNaN);
    seq_k3[s] = static_cast<float>(seq.tokens ? seq.k3 / k : kNaN);
    seq_band[s] = static_cast<float>(seq.tokens ? static_cast<double>(seq.outside_band) / k : kNaN);
    seq_ratio[s] = static_cast<float>(seq.tokens ? Capped(std::exp(seq.log_ratio), in.ratio_cap) : kNaN);
    seq_geo[s] = static_cast<float>(seq.tokens ? Capped(std::exp(seq.log_ratio / k), in.ratio_cap) : kNaN);
  }
  v1::RolloutMismatch* m = resp->mutable_rollout_mismatch();
  const double k = static_cast<double>(request.tokens);
  m->set_tokens(request.tokens);
  m->set_mean_abs_log_ratio(request.tokens ? request.abs_log_ratio / k : kNaN);
  m->set_k1(request.tokens ? -request.log_ratio / k : kNaN);
  m->set_k3(request.tokens ? request.k3 / k : kNaN);
  m->set_outside_band_fraction(request.tokens ? static_cast<double>(request.outside_band) / k : kNaN);
  seen.outside_band = request.outside_band;
  seen.k3 = m->k3();
  return seen;
}

}  // namespace logprob
