#include "client/request_builder.h"

#include <utility>

#include "absl/strings/str_cat.h"

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
  options.set_topk(flags.topk);
  if (flags.temperature) options.set_temperature(*flags.temperature);
  options.set_sampling_top_k(flags.sampling_top_k);
  if (flags.sampling_top_p) options.set_sampling_top_p(*flags.sampling_top_p);
  if (flags.ignore_index) options.set_ignore_index(*flags.ignore_index);
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

absl::StatusOr<v1::ScoreRequest> BuildScoreRequest(SafetensorsFile file, const v1::ScoreOptions& options,
                                                   const std::string& id) {
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

}  // namespace logprob::client
