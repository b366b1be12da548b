// What a model's head does to h W^T before temperature: an optional bias,
// a logit multiplier and a final-logit softcap, in the models' own order
// (and TRL's, trl/trainer/utils.py add_fused_lm_head):
//
//   z = softcap(logit_scale * (h W^T + b)),  softcap(x) = c * tanh(x / c)
//
// then x = z / temperature. Applied element-wise in float32 to the f32
// GEMM output, so a logit depends only on its own GEMM output, bias and the
// head's scalars: batch invariance is kept. TransformLogit
// (common/lm_head_logit.h) is the definition: ApplyLmHeadTransform applies
// it to a tile, the CUDA kernel worker/cuda/lm_head_transform.cu calls it
// per element, and the CPU backend runs its SIMD twin
// (worker/kernels/lm_head_transform_simd.h: the same operations, a vector
// tanh).
//
// The scalars come from a Hugging Face config.json (LmHeadScalarsFromConfig)
// or from logprob-server's --lm-head-logit-scale / --lm-head-softcap.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/lm_head_logit.h"

namespace logprob {

/// A head's logit transform. The identity (no bias, scale 1, no softcap)
/// is the default: the head's logits are h W^T.
struct LmHeadTransform {
  bool has_bias = false;     // the head has a bias [V] (added first)
  double logit_scale = 1.0;  // multiplier after the bias; > 0
  double softcap = 0.0;      // c of c * tanh(x / c), after the multiplier; 0: none, else > 0

  /// True when it changes nothing (the GEMM output is the logits).
  bool identity() const { return !has_bias && logit_scale == 1.0 && softcap == 0.0; }
  bool operator==(const LmHeadTransform& o) const {
    return has_bias == o.has_bias && logit_scale == o.logit_scale && softcap == o.softcap;
  }
  bool operator!=(const LmHeadTransform& o) const { return !(*this == o); }
  /// "bias, logit_scale 0.125, softcap 30" or "none", for logs and errors.
  std::string ToString() const;
};

/// logits[M, N] (f32, row-major, in place) = TransformLogit of each element
/// with bias[n] of its column (`bias` [N] f32, or null: no bias) and the
/// scalars of `t`. `bias` must be non-null exactly when t.has_bias (the
/// caller's slice of the head's bias). M * N elements, no allocation;
/// thread-safe on distinct buffers.
void ApplyLmHeadTransform(const LmHeadTransform& t, const float* bias, int64_t M, int64_t N, float* logits);

/// The ranges of a head's transform scalars: a logit multiplier in
/// [kMinLogitScale, kMaxLogitScale] and a final-logit softcap of 0 (none) or
/// in [kMinLogitScale, kMaxLogitScale]. Real checkpoints use 0.0625
/// (Cohere) to 16 (Granite's 1 / logits_scaling) and softcaps of 30 or 50;
/// the bounds keep a head the server accepts from overflowing float32 by
/// its scalars alone (a logit_scale of 1e308).
inline constexpr double kMinLogitScale = 1e-6;
inline constexpr double kMaxLogitScale = 1e6;

/// OK when `logit_scale` and `softcap` are in the ranges above;
/// INVALID_ARGUMENT naming `scale_name` or `softcap_name` (the field or
/// flag the value came from) otherwise. Pure. The one rule the front-end
/// (flags, config.json, updates) and the workers apply.
absl::Status CheckLmHeadScalars(double logit_scale, double softcap, const std::string& scale_name = "logit_scale",
                                const std::string& softcap_name = "final_logit_softcapping");
/// The two halves of CheckLmHeadScalars, for a value given alone (a flag).
absl::Status CheckLogitScale(double logit_scale, const std::string& name);
absl::Status CheckSoftcap(double softcap, const std::string& name);

/// The scalars of a head and where each came from (for messages).
struct LmHeadScalars {
  double logit_scale = 1.0;
  double softcap = 0.0;
  std::string logit_scale_from;  // the config attribute (e.g. "logits_scaling"), a flag, or "" (default)
  std::string softcap_from;
  /// The config says "lm_head_bias": true (PhiMoE, Zaya): the checkpoint
  /// must hold the head's bias.
  bool bias_required = false;
};

/// Reads a head's logit multiplier and final-logit softcap from the text of
/// a Hugging Face config.json (`where`: its path, for messages). The text
/// config is the object under "text_config", "decoder", "generator" or
/// "text_encoder" when the config has one (transformers'
/// get_text_config(); several: INVALID_ARGUMENT), else the whole object.
/// Rule (TRL's add_fused_lm_head, docs/serving.md "Head transforms"):
///  - softcap: "final_logit_softcapping"; "logits_soft_cap"
///    (RecurrentGemma) and "output_logit_soft_cap" (xLSTM) are the same
///    transform under other names;
///  - multiplier: the first of "logit_scale" (Cohere, MPT), "output_multiplier",
///    "lm_head_multiplier" (Falcon-H1) that is present and not null, else
///    1 / "logits_scaling" (Granite, MiniCPM3), or "logits_scaling" itself
///    for model_type "hyperclovax";
///  - an attribute absent from the file takes transformers' default for the
///    config's model_type (e.g. gemma2: softcap 30, cohere: logit_scale
///    0.0625); null means none;
///  - "lm_head_bias": true sets bias_required (a bool, else an error).
/// Errors, INVALID_ARGUMENT naming the attribute: a value that is not a
/// number (e.g. MPT's "inv_sqrt_d_model"), not finite or not > 0; two
/// softcap attributes that disagree; and any other key containing "logit"
/// that is not known to leave the head alone (attention-side or router
/// keys such as "attn_logit_softcapping", "output_router_logits"): the
/// server cannot reproduce what it does, so it refuses rather than score
/// the head wrong (kLmHeadConfigIgnoredKeys lists the known ones). Also
/// INVALID_ARGUMENT for text that is not a JSON object.
absl::StatusOr<LmHeadScalars> LmHeadScalarsFromConfig(std::string_view config_json, const std::string& where);

/// The keys containing "logit" that are known not to act on the output
/// head's logits (attention softcaps, router and contrastive-loss options,
/// counts), null-terminated; LmHeadScalarsFromConfig ignores them.
extern const char* const kLmHeadConfigIgnoredKeys[];

}  // namespace logprob
