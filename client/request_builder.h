// Turning a safetensors input file and command-line options into one
// ScoreRequest (docs/SPEC.md "Inputs").
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob::client {

/// Names of the input tensors a score request carries, in the order they
/// are sent: the scored rows (`logits` or `hidden_states`), `input_ids`,
/// then the optional `cu_seqlens`, `seq_lens`, `gather_indices`.
inline constexpr char kLogitsName[] = "logits";
inline constexpr char kHiddenStatesName[] = "hidden_states";
inline constexpr char kInputIdsName[] = "input_ids";
inline constexpr char kCuSeqlensName[] = "cu_seqlens";
inline constexpr char kSeqLensName[] = "seq_lens";
inline constexpr char kGatherIndicesName[] = "gather_indices";
inline constexpr char kRolloutLogprobsName[] = "rollout_logprobs";
inline constexpr char kSamplingMaskOffsetsName[] = "sampling_mask_offsets";
inline constexpr char kSamplingMaskIdsName[] = "sampling_mask_ids";

/// Scoring options as given on the command line; unset fields stay unset
/// in the request so the server applies its defaults.
struct ScoreFlags {
  v1::Alignment alignment = v1::NEXT_TOKEN;
  bool entropy = false;
  bool log_sum_sq_probs = false;  // --log-sum-sq-probs
  bool mean_logits = false;       // --mean-logits
  bool is_top1 = false;           // --is-top1
  int32_t topk = 0;
  std::optional<float> temperature;
  int32_t sampling_top_k = 0;
  std::optional<float> sampling_top_p;
  std::optional<int64_t> ignore_index;
  std::optional<double> rollout_ratio_cap;  // --rollout-ratio-cap
  std::optional<double> rollout_band_low;   // --rollout-band LOW,HIGH
  std::optional<double> rollout_band_high;
};

/// Parses "next_token" or "same_position". INVALID_ARGUMENT otherwise.
absl::StatusOr<v1::Alignment> ParseAlignment(std::string_view name);

/// Copies `flags` into a ScoreOptions message; optional fields are set only
/// when the flag was given.
v1::ScoreOptions ToScoreOptions(const ScoreFlags& flags);

/// Builds a request with id `id` from the tensors of an input file. Takes
/// exactly one of `logits` [B,S,V] / [T,V] or `hidden_states` [B,S,H] /
/// [T,H], plus `input_ids`, and `cu_seqlens`, `seq_lens`, `gather_indices`
/// when present; names, dtypes, shapes and bytes are sent unchanged (the
/// server validates shapes and dtypes). Other tensors in the file are
/// ignored. The tensors are moved out of `file`. `rollout_logprobs`
/// (the CLI's --rollout-logprobs NAME), when not empty, names the F32
/// tensor sent as `rollout_logprobs` (docs/SPEC.md "Rollout mismatch").
/// `sampling_mask` (--sampling-mask NAME), when not empty, names the pair
/// NAME_offsets / NAME_ids sent as `sampling_mask_offsets` /
/// `sampling_mask_ids` (docs/SPEC.md "Sampling masks").
/// Errors (INVALID_ARGUMENT): no `input_ids`, neither or both of `logits`
/// and `hidden_states`, no tensor `rollout_logprobs` or one not F32, no
/// tensor NAME_offsets or NAME_ids.
absl::StatusOr<v1::ScoreRequest> BuildScoreRequest(SafetensorsFile file, const v1::ScoreOptions& options,
                                                   const std::string& id, const std::string& rollout_logprobs = "",
                                                   const std::string& sampling_mask = "");

/// The name in the input file of request input `name`: the tensors that
/// --rollout-logprobs and --sampling-mask rename come from those flags'
/// names, every other from its own.
std::string SourceTensorName(const std::string& name, const std::string& rollout_logprobs,
                             const std::string& sampling_mask);

/// `request` with ScoreRequest.head = `head` and head_version =
/// `head_version` (the CLI's --head / --head-version; empty leaves the
/// field unset: the server's "default" or only head, its current version).
/// The names are checked by the server (NOT_FOUND for a head it does not
/// hold, FAILED_PRECONDITION for a version it does not hold).
/// Errors (INVALID_ARGUMENT): a head or version given for a request that
/// scores `logits` (they select the lm_head of `hidden_states`).
absl::StatusOr<v1::ScoreRequest> SelectLmHead(v1::ScoreRequest request, const std::string& head,
                                              const std::string& head_version);

/// Number of token positions of a built request: the product of the
/// leading dimensions (all but the last) of `logits` / `hidden_states`,
/// i.e. B*S for padded and T for packed input; 0 when absent.
int64_t CountInputTokens(const v1::ScoreRequest& request);

/// The bytes of input tensor `name` of a request (its `data`, or where the
/// caller keeps them when they travel apart, e.g. in pieces).
using TensorBytes = std::function<std::string_view(const std::string& name)>;

/// Number of token positions the server scores for a built request
/// (docs/SPEC.md): per sequence its length (`seq_lens`, `cu_seqlens`, else
/// S) minus one for `next_token`, less the positions whose target is
/// `ignore_index` (default -100), which score 0. Padding and the last
/// position of each sequence are not counted. -1 when the request's
/// `input_ids`, `seq_lens` or `cu_seqlens` cannot be read (bad dtype or
/// size: the server refuses such requests).
int64_t CountScoredTokens(const v1::ScoreRequest& request, const TensorBytes& bytes_of);

}  // namespace logprob::client
