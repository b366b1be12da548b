#include "common/lm_head_source_proto.h"

#include "absl/strings/str_cat.h"

namespace logprob {

absl::StatusOr<LmHeadSource> LmHeadSourceFromProto(const internal::v1::LmHeadSource& src, const std::string& what) {
  LmHeadSource source;
  source.file = src.file();
  source.tensor = src.tensor();
  source.dtype = src.dtype();
  source.vocab_size = src.vocab_size();
  source.hidden_size = src.hidden_size();
  source.data_offset = src.data_offset();
  source.transform.logit_scale = src.logit_scale() == 0 ? 1.0 : src.logit_scale();  // 0: unset
  source.transform.softcap = src.final_logit_softcapping();
  source.transform.has_bias = !src.bias_file().empty();
  source.bias.file = src.bias_file();
  source.bias.tensor = src.bias_tensor();
  source.bias.dtype = src.bias_dtype();
  source.bias.data_offset = src.bias_offset();
  if (source.transform.has_bias && !IsFloatDType(source.bias.dtype))
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": bias dtype ", DTypeName(source.bias.dtype), " is not F32, BF16 or F16"));
  if (source.vocab_size <= 0 || source.hidden_size <= 0 || !IsFloatDType(source.dtype))
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": bad shape [", source.vocab_size, ", ", source.hidden_size, "] or dtype"));
  return source;
}

}  // namespace logprob
