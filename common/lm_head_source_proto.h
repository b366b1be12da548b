// The worker protocol's LmHeadSource (proto/logprob/internal/v1/worker.proto)
// as the LmHeadSource that ReadLmHeadRows / ReadLmHeadBias read: the one
// conversion the worker (loading a slice) and the front-end (serving a
// slice to a worker without its filesystem) share.
#pragma once

#include "absl/status/statusor.h"
#include "common/lm_head_source.h"
#include "logprob/internal/v1/worker.pb.h"

namespace logprob {

/// `src` as an LmHeadSource (logit_scale 0 read as 1; has_bias exactly when
/// bias_file is set). INVALID_ARGUMENT, naming `what` (e.g. "LoadLmHead
/// policy@step-3"), for a shape with V or H <= 0, or a weight or bias dtype
/// other than F32, BF16 or F16.
absl::StatusOr<LmHeadSource> LmHeadSourceFromProto(const internal::v1::LmHeadSource& src, const std::string& what);

}  // namespace logprob
