#include "common/lm_head_transform.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace logprob {

const char* const kLmHeadConfigIgnoredKeys[] = {
    // attention-side softcaps and caps (Gemma 2/3n/4, Grok-style)
    "attn_logit_softcapping",
    "attention_logit_cap",
    "conf_attention_logit_cap",
    "attention_invalid_logits_value",
    // MoE routers
    "output_router_logits",
    "router_logits",
    "moe_router_logit_softcapping",
    // what the forward returns or keeps, not what the head computes
    "num_logits_to_keep",
    "output_auxiliary_logits",
    // contrastive (CLIP-style) heads and other non-LM uses of the word
    "logit_scale_init_value",
    "max_logit_scale",
    "contrastive_logits_temperature",
    "lsd_time_logit_mean",
    "lsd_time_logit_std",
    "average_logits_per_cell",
    // training and compute options of the head
    "freeze_lm_head",
    "chunk_size_lm_head",
    nullptr,
};

namespace {

/// What kind of JSON value `j` is ("a string", "an array", ...): what an
/// error says of a config.json value, never the value itself (a file's
/// contents are not echoed to the caller).
const char* JsonKind(const nlohmann::json& j) {
  if (j.is_string()) return "a string";
  if (j.is_array()) return "an array";
  if (j.is_object()) return "an object";
  if (j.is_boolean()) return "a boolean";
  if (j.is_number()) return "a number";
  return "null";
}

using nlohmann::json;

// The attributes read here (besides "lm_head_bias", which the caller checks).
constexpr const char* kSoftcapKeys[] = {"final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"};
constexpr const char* kMultiplierKeys[] = {"logit_scale", "output_multiplier", "lm_head_multiplier"};
constexpr const char* kDivisorKey = "logits_scaling";

// transformers' defaults of the head attributes, by model_type, where they
// are not "none" (a config.json written by save_pretrained lists them, a
// hand-written one may not).
struct ModelDefault {
  const char* model_type;
  const char* key;
  double value;
};
// (transformers' configuration classes; the text config's model_type for
// composite models.)
constexpr ModelDefault kModelDefaults[] = {
    {"gemma2", "final_logit_softcapping", 30.0},
    {"gemma3n_text", "final_logit_softcapping", 30.0},
    {"vaultgemma", "final_logit_softcapping", 30.0},
    {"beam", "final_logit_softcapping", 30.0},
    {"inkling2_text", "final_logit_softcapping", 30.0},
    {"inkling2_loop_text", "final_logit_softcapping", 30.0},
    {"mistral_large4_text", "final_logit_softcapping", 30.0},
    {"nanochat", "final_logit_softcapping", 15.0},
    {"muse_glimmer_text", "final_logit_softcapping", 20.0},
    {"muse_glimmer_text", "output_multiplier", 0.19611613513818404},
    {"muse_spark_text", "final_logit_softcapping", 20.0},
    {"muse_spark_text", "output_multiplier", 0.1767766952966369},
    {"recurrent_gemma", "logits_soft_cap", 30.0},
    {"xlstm", "output_logit_soft_cap", 30.0},
    {"cohere", "logit_scale", 0.0625},
    {"cohere2", "logit_scale", 0.0625},
    {"cohere2_moe", "logit_scale", 0.0625},
    {"granite_docling_text", "logits_scaling", 4.0},
};

bool Known(const std::string& key) {
  for (const char* k : kSoftcapKeys)
    if (key == k) return true;
  for (const char* k : kMultiplierKeys)
    if (key == k) return true;
  if (key == kDivisorKey || key == "lm_head_bias") return true;
  for (const char* const* k = kLmHeadConfigIgnoredKeys; *k != nullptr; ++k)
    if (key == *k) return true;
  return false;
}

// A key that may act on the head's logits: contains "logit" or "lm_head".
bool HeadRelated(const std::string& key) {
  const std::string lower = absl::AsciiStrToLower(key);
  return absl::StrContains(lower, "logit") || absl::StrContains(lower, "lm_head");
}

// The value of `key` in `cfg`: nullopt-like (has = false) when absent or
// null; else a finite number > 0, or INVALID_ARGUMENT naming it.
absl::StatusOr<std::pair<bool, double>> Positive(const json& cfg, const char* key,
                                                 const std::vector<std::string>& model_types, const std::string& where,
                                                 const std::string& prefix) {
  auto it = cfg.find(key);
  if (it == cfg.end()) {
    for (const ModelDefault& d : kModelDefaults)
      for (const std::string& type : model_types)
        if (type == d.model_type && std::string(key) == d.key) return std::make_pair(true, d.value);
    return std::make_pair(false, 0.0);
  }
  if (it->is_null()) return std::make_pair(false, 0.0);
  if (!it->is_number())
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", prefix, key, " is ", JsonKind(*it),
                                                   ", not a number: the server cannot reproduce this head's logits"));
  const double v = it->get<double>();
  if (!std::isfinite(v) || v <= 0)
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", prefix, key, " is ",
                                                   v <= 0 ? "not positive" : "not finite",
                                                   "; the server needs a finite number > 0"));
  return std::make_pair(true, v);
}

}  // namespace

std::string LmHeadTransform::ToString() const {
  std::vector<std::string> parts;
  if (has_bias) parts.push_back("bias");
  if (logit_scale != 1.0) parts.push_back(absl::StrCat("logit_scale ", logit_scale));
  if (softcap != 0.0) parts.push_back(absl::StrCat("softcap ", softcap));
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

void ApplyLmHeadTransform(const LmHeadTransform& t, const float* bias, int64_t M, int64_t N, float* logits) {
  if (t.identity()) return;
  const float scale = static_cast<float>(t.logit_scale), cap = static_cast<float>(t.softcap);
  for (int64_t m = 0; m < M; ++m) {
    float* row = logits + m * N;
    if (bias != nullptr) {
      for (int64_t n = 0; n < N; ++n) row[n] = TransformLogit(row[n], bias[n], scale, cap);
    } else {
      for (int64_t n = 0; n < N; ++n) row[n] = TransformLogit(row[n], 0.0f, scale, cap);
    }
  }
}

absl::StatusOr<LmHeadScalars> LmHeadScalarsFromConfig(std::string_view config_json, const std::string& where) {
  const json root = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object())
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
  // transformers' get_text_config(): the one text sub-config, if any.
  const json* cfg = &root;
  std::string prefix;
  std::vector<std::string> subs;
  for (const char* name : {"text_encoder", "decoder", "generator", "text_config"}) {
    auto it = root.find(name);
    if (it != root.end() && it->is_object()) {
      subs.push_back(name);
      cfg = &*it;
      prefix = absl::StrCat(name, ".");
    }
  }
  if (subs.size() > 1)
    return absl::InvalidArgumentError(absl::StrCat(where, ": several text configs (", absl::StrJoin(subs, ", "),
                                                   "); the server cannot tell which one the head belongs to"));
  // Unknown head-related keys, in the text config and (for a composite
  // config) at the top level too.
  for (const json* obj : {cfg, &root}) {
    const std::string p = obj == cfg ? prefix : "";
    for (auto it = obj->begin(); it != obj->end(); ++it)
      if (HeadRelated(it.key()) && !Known(it.key()))
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": attribute ", p, it.key(),
                         " may change the head's logits in a way the server cannot reproduce (it knows "
                         "final_logit_softcapping, logit_scale, output_multiplier, lm_head_multiplier, "
                         "logits_scaling; see docs/serving.md \"Head transforms\"); refusing the head"));
    if (cfg == &root) break;
  }
  auto model_type_of = [](const json& obj) {
    auto it = obj.find("model_type");
    return it != obj.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  // The text config's model_type; a text config without one is taken as
  // its model's (the root's, or the root's "_text" sub-config).
  const std::string root_type = model_type_of(root);
  const std::string text_type = model_type_of(*cfg);
  std::vector<std::string> model_types = {text_type};
  if (text_type.empty() && cfg != &root) model_types = {root_type, root_type + "_text"};
  const bool hyperclovax =
      text_type == "hyperclovax" || (text_type.empty() && cfg != &root && absl::StartsWith(root_type, "hyperclovax"));

  LmHeadScalars out;
  for (const char* key : kSoftcapKeys) {
    auto v = Positive(*cfg, key, model_types, where, prefix);
    if (!v.ok()) return v.status();
    if (!v->first) continue;
    if (!out.softcap_from.empty() && out.softcap != v->second)
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", prefix, out.softcap_from, " is ", out.softcap,
                                                     " but ", prefix, key, " is ", v->second,
                                                     "; the head's softcap is ambiguous"));
    out.softcap = v->second;
    out.softcap_from = key;
  }
  for (const char* key : kMultiplierKeys) {  // the first present (TRL's order); the others must still be numbers
    auto v = Positive(*cfg, key, model_types, where, prefix);
    if (!v.ok()) return v.status();
    if (v->first && out.logit_scale_from.empty()) {
      out.logit_scale = v->second;
      out.logit_scale_from = key;
    }
  }
  auto div = Positive(*cfg, kDivisorKey, model_types, where, prefix);
  if (!div.ok()) return div.status();
  if (div->first && out.logit_scale_from.empty()) {
    out.logit_scale = hyperclovax ? div->second : 1.0 / div->second;
    out.logit_scale_from = kDivisorKey;
  }
  if (auto it = cfg->find("lm_head_bias"); it != cfg->end() && !it->is_null()) {
    if (!it->is_boolean())
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", prefix, "lm_head_bias is ", JsonKind(*it), ", not true or false"));
    out.bias_required = it->get<bool>();
  }
  if (!out.logit_scale_from.empty()) out.logit_scale_from = prefix + out.logit_scale_from;
  if (!out.softcap_from.empty()) out.softcap_from = prefix + out.softcap_from;
  LOGPROB_RETURN_IF_ERROR(
      CheckLmHeadScalars(out.logit_scale, out.softcap,
                         where + ": " + (out.logit_scale_from.empty() ? "logit_scale" : out.logit_scale_from),
                         where + ": " + (out.softcap_from.empty() ? "final_logit_softcapping" : out.softcap_from)));
  return out;
}

absl::Status CheckLogitScale(double logit_scale, const std::string& name) {
  if (!(logit_scale >= kMinLogitScale && logit_scale <= kMaxLogitScale))
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", logit_scale, ": must be in [", kMinLogitScale, ", ", kMaxLogitScale, "]"));
  return absl::OkStatus();
}

absl::Status CheckSoftcap(double softcap, const std::string& name) {
  if (!(softcap == 0 || (softcap >= kMinLogitScale && softcap <= kMaxLogitScale)))
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", softcap, ": must be 0 (none) or in [", kMinLogitScale, ", ", kMaxLogitScale, "]"));
  return absl::OkStatus();
}

absl::Status CheckLmHeadScalars(double logit_scale, double softcap, const std::string& scale_name,
                                const std::string& softcap_name) {
  LOGPROB_RETURN_IF_ERROR(CheckLogitScale(logit_scale, scale_name));
  return CheckSoftcap(softcap, softcap_name);
}

}  // namespace logprob
