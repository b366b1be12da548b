#include "server/inputs/request_inputs.h"

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "common/status_macros.h"
#include "server/inputs/shared_inputs.h"

namespace logprob {
namespace {

std::string What(const v1::ScoreRequest& req, int i) {
  return absl::StrCat("inputs[", i, "] \"", req.inputs(i).name(), "\"");
}

/// Which tensors a kind may carry: checked before its reference is resolved.
absl::Status CheckTensor(const v1::ScoreRequest& req, int i, const InputKindRules& rules) {
  if (rules.hidden_states_only && req.inputs(i).name() != "hidden_states")
    return absl::InvalidArgumentError(absl::StrCat(What(req, i), ": a ", rules.name,
                                                   " reference is only accepted for \"hidden_states\"; send this "
                                                   "tensor's bytes"));
  return absl::OkStatus();
}

/// What the request's options need of a kind: checked once its reference
/// is resolved (a malformed reference is reported first).
absl::Status CheckOptions(const v1::ScoreRequest& req, int i, const InputKindRules& rules) {
  bool masks = false;
  for (const v1::Tensor& t : req.inputs()) masks |= t.name() == "sampling_mask_ids";
  if (!rules.sampling_filters && masks)
    return WithReason(absl::FailedPreconditionError(absl::StrCat(
                          What(req, i), ": a ", rules.name,
                          " input cannot be scored with a sampling mask (masked rows are scored from logits in "
                          "host memory); send the tensor as bytes (inline or through shared memory) instead")),
                      rules.unavailable);
  if (!rules.sampling_filters && HasSamplingFilters(req.options()))
    return WithReason(
        absl::FailedPreconditionError(absl::StrCat(What(req, i), ": a ", rules.name,
                                                   " input cannot be scored with options.sampling_top_k / "
                                                   "options.sampling_top_p (sampling filters score hidden "
                                                   "states in rounds through host memory); send the tensor as bytes "
                                                   "(inline or through shared memory) instead")),
        rules.unavailable);
  return absl::OkStatus();
}

}  // namespace

RequestInputs InlineInputs(const v1::ScoreRequest& req) {
  RequestInputs out;
  for (const v1::Tensor& t : req.inputs()) out.sources.push_back(MemorySource(t.data()));
  return out;
}

absl::StatusOr<RequestInputs> ResolveInputs(const v1::ScoreRequest& req, const InputContext& context) {
  RequestInputs out;
  std::string owner;
  bool have_owner = false;
  for (int i = 0; i < req.inputs_size(); ++i) {
    const v1::Tensor& t = req.inputs(i);
    const InputKind kind = KindOf(t);
    LOGPROB_RETURN_IF_ERROR(CheckTensor(req, i, RulesOf(kind)));
    std::shared_ptr<const InputSource> source;
    switch (kind) {
      case InputKind::kBytes:
        source = MemorySource(t.data());
        break;
      case InputKind::kSharedMemory: {
        if (context.regions == nullptr) return SharedMemoryInputsOff();
        if (!have_owner) {
          if (!context.session) return absl::InvalidArgumentError("shared-memory references need a call's session");
          LOGPROB_ASSIGN_OR_RETURN(owner, context.session());
          out.session_hold = context.regions->Hold(owner);
          have_owner = true;
        }
        LOGPROB_ASSIGN_OR_RETURN(source, ResolveSharedMemory(t, i, *context.regions, owner));
        break;
      }
      case InputKind::kCudaIpc: {
        LOGPROB_ASSIGN_OR_RETURN(source, ResolveCudaIpc(t, i, context.cuda_ipc, context.peer));
        break;
      }
      case InputKind::kFile:  // no Tensor names a file (LmHeadRows.file does)
        return absl::InvalidArgumentError(absl::StrCat(What(req, i), ": file sources are only for lm_head updates"));
    }
    LOGPROB_RETURN_IF_ERROR(CheckOptions(req, i, RulesOf(kind)));
    if (kind != InputKind::kBytes) out.referenced_bytes += source->byte_size();
    out.sources.push_back(std::move(source));
  }
  return out;
}

}  // namespace logprob
