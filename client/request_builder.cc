#include "client/request_builder.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace logprob::client {

absl::StatusOr<v1::Alignment> ParseAlignment(std::string_view name) {
  if (name == "next_token") return v1::NEXT_TOKEN;
  if (name == "same_position") return v1::SAME_POSITION;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown alignment '", std::string(name), "' (expected next_token or same_position)"));
}

v1::ScoreOptions ToScoreOptions(const ScoreFlags& flags) {
  v1::ScoreOptions options;
  options.set_alignment(flags.alignment);
  options.set_entropy(flags.entropy);
  options.set_log_sum_sq_probs(flags.log_sum_sq_probs);
  options.set_mean_logits(flags.mean_logits);
  options.set_is_top1(flags.is_top1);
  options.set_topk(flags.topk);
  if (flags.temperature) options.set_temperature(*flags.temperature);
  options.set_sampling_top_k(flags.sampling_top_k);
  if (flags.sampling_top_p) options.set_sampling_top_p(*flags.sampling_top_p);
  if (flags.ignore_index) options.set_ignore_index(*flags.ignore_index);
  if (flags.rollout_ratio_cap) options.set_rollout_ratio_cap(*flags.rollout_ratio_cap);
  if (flags.rollout_band_low) options.set_rollout_band_low(*flags.rollout_band_low);
  if (flags.rollout_band_high) options.set_rollout_band_high(*flags.rollout_band_high);
  return options;
}

namespace {

// Index of the tensor called `name` in `file`, or -1.
int FindIndex(const SafetensorsFile& file, std::string_view name) {
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    if (file.tensors[i].name() == name) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

std::string SourceTensorName(const std::string& name, const std::string& rollout_logprobs,
                             const std::string& sampling_mask) {
  if (name == kRolloutLogprobsName && !rollout_logprobs.empty()) return rollout_logprobs;
  if (name == kSamplingMaskOffsetsName && !sampling_mask.empty()) return sampling_mask + "_offsets";
  if (name == kSamplingMaskIdsName && !sampling_mask.empty()) return sampling_mask + "_ids";
  return name;
}

absl::StatusOr<v1::ScoreRequest> BuildScoreRequest(SafetensorsFile file, const v1::ScoreOptions& options,
                                                   const std::string& id, const std::string& rollout_logprobs,
                                                   const std::string& sampling_mask) {
  const int logits = FindIndex(file, kLogitsName);
  const int hidden = FindIndex(file, kHiddenStatesName);
  if (logits >= 0 && hidden >= 0) {
    return absl::InvalidArgumentError("input has both 'logits' and 'hidden_states'; keep only one");
  }
  if (logits < 0 && hidden < 0) {
    return absl::InvalidArgumentError("input has neither 'logits' nor 'hidden_states'");
  }
  if (FindIndex(file, kInputIdsName) < 0) {
    return absl::InvalidArgumentError("input has no 'input_ids'");
  }

  int rollout = -1;
  if (!rollout_logprobs.empty()) {
    rollout = FindIndex(file, rollout_logprobs);
    if (rollout < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("--rollout-logprobs: input has no tensor '", rollout_logprobs, "'"));
    if (file.tensors[rollout].dtype() != v1::F32)
      return absl::InvalidArgumentError(absl::StrCat("--rollout-logprobs: tensor '", rollout_logprobs, "' is ",
                                                     DTypeName(file.tensors[rollout].dtype()), "; store it as F32"));
    if (rollout == logits || rollout == hidden)
      return absl::InvalidArgumentError(
          absl::StrCat("--rollout-logprobs: '", rollout_logprobs, "' is the input's scores, not its logprobs"));
  }

  int mask_offsets = -1, mask_ids = -1;
  if (!sampling_mask.empty()) {
    mask_offsets = FindIndex(file, sampling_mask + "_offsets");
    mask_ids = FindIndex(file, sampling_mask + "_ids");
    if (mask_offsets < 0 || mask_ids < 0)
      return absl::InvalidArgumentError(absl::StrCat("--sampling-mask: input has no tensor '", sampling_mask,
                                                     mask_offsets < 0 ? "_offsets'" : "_ids'"));
  }

  v1::ScoreRequest request;
  request.set_id(id);
  *request.mutable_options() = options;
  const char* const order[] = {logits >= 0 ? kLogitsName : kHiddenStatesName, kInputIdsName, kCuSeqlensName,
                               kSeqLensName, kGatherIndicesName};
  for (const char* name : order) {
    const int i = FindIndex(file, name);
    if (i < 0) continue;
    *request.add_inputs() = std::move(file.tensors[i]);
  }
  if (rollout >= 0) {
    v1::Tensor* t = request.add_inputs();
    *t = std::move(file.tensors[rollout]);
    t->set_name(kRolloutLogprobsName);
  }
  for (const auto& [i, name] :
       {std::pair{mask_offsets, kSamplingMaskOffsetsName}, std::pair{mask_ids, kSamplingMaskIdsName}}) {
    if (i < 0) continue;
    v1::Tensor* t = request.add_inputs();
    *t = std::move(file.tensors[i]);
    t->set_name(name);
  }
  return request;
}

absl::StatusOr<v1::ScoreRequest> SelectLmHead(v1::ScoreRequest request, const std::string& head,
                                              const std::string& head_version) {
  if (head.empty() && head_version.empty()) return request;
  const bool hidden = std::any_of(request.inputs().begin(), request.inputs().end(),
                                  [](const v1::Tensor& t) { return t.name() == kHiddenStatesName; });
  if (!hidden)
    return absl::InvalidArgumentError(
        "--head / --head-version select the lm_head that multiplies 'hidden_states'; this input has 'logits'");
  request.set_head(head);
  request.set_head_version(head_version);
  return request;
}

int64_t CountInputTokens(const v1::ScoreRequest& request) {
  for (const v1::Tensor& t : request.inputs()) {
    if (t.name() != kLogitsName && t.name() != kHiddenStatesName) continue;
    if (t.shape_size() < 2) return 0;
    int64_t n = 1;
    for (int d = 0; d + 1 < t.shape_size(); ++d) n *= t.shape(d);
    return n;
  }
  return 0;
}

namespace {

/// Integer values of an I32 / I64 tensor's bytes; false for another dtype
/// or a size that does not match `count`.
bool ReadInts(const v1::Tensor& t, std::string_view bytes, int64_t count, std::vector<int64_t>* out) {
  const size_t width = t.dtype() == v1::I64 ? 8 : t.dtype() == v1::I32 ? 4 : 0;
  if (width == 0 || count < 0 || bytes.size() != static_cast<size_t>(count) * width) return false;
  out->resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    if (width == 8) {
      int64_t v;
      std::memcpy(&v, bytes.data() + i * 8, 8);
      (*out)[i] = v;
    } else {
      int32_t v;
      std::memcpy(&v, bytes.data() + i * 4, 4);
      (*out)[i] = v;
    }
  }
  return true;
}

const v1::Tensor* FindInput(const v1::ScoreRequest& request, const char* name) {
  for (const v1::Tensor& t : request.inputs())
    if (t.name() == name) return &t;
  return nullptr;
}

}  // namespace

int64_t CountScoredTokens(const v1::ScoreRequest& request, const TensorBytes& bytes_of) {
  const v1::Tensor* ids_t = FindInput(request, kInputIdsName);
  if (ids_t == nullptr || ids_t->shape_size() < 1 || ids_t->shape_size() > 2) return -1;
  int64_t count = 1;
  for (int64_t d : ids_t->shape()) count *= d;
  std::vector<int64_t> ids;
  if (!ReadInts(*ids_t, bytes_of(kInputIdsName), count, &ids)) return -1;
  // Each sequence as [begin, end) of ids (flattened).
  std::vector<std::pair<int64_t, int64_t>> sequences;
  if (ids_t->shape_size() == 2) {
    const int64_t b = ids_t->shape(0), s = ids_t->shape(1);
    std::vector<int64_t> lens(static_cast<size_t>(b), s);
    if (const v1::Tensor* sl = FindInput(request, kSeqLensName); sl != nullptr) {
      if (!ReadInts(*sl, bytes_of(kSeqLensName), b, &lens)) return -1;
    }
    for (int64_t i = 0; i < b; ++i) sequences.emplace_back(i * s, i * s + std::clamp<int64_t>(lens[i], 0, s));
  } else {
    const v1::Tensor* cu_t = FindInput(request, kCuSeqlensName);
    if (cu_t == nullptr || cu_t->shape_size() != 1) return -1;
    std::vector<int64_t> cu;
    if (!ReadInts(*cu_t, bytes_of(kCuSeqlensName), cu_t->shape(0), &cu)) return -1;
    for (size_t i = 0; i + 1 < cu.size(); ++i) {
      if (cu[i] < 0 || cu[i] > cu[i + 1] || cu[i + 1] > count) return -1;
      sequences.emplace_back(cu[i], cu[i + 1]);
    }
  }
  const bool next = request.options().alignment() == v1::NEXT_TOKEN;
  const int64_t ignore = request.options().has_ignore_index() ? request.options().ignore_index() : -100;
  int64_t scored = 0;
  for (const auto& [begin, end] : sequences) {
    for (int64_t t = begin + (next ? 1 : 0); t < end; ++t) scored += ids[t] != ignore ? 1 : 0;
  }
  return scored;
}

}  // namespace logprob::client
