// Heads declared at start by shape and dtype (--lm-head-declare
// NAME=VxH:DTYPE): no checkpoint path, so no file any node must see. Such
// a head is not servable until an update fills it (docs/lm-head-updates.md
// "Declared heads"); the update's Begin may set its logit transform.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/heads/lm_heads.h"

namespace logprob {

/// LmHeadVersion::origin of a declared head's placeholder: the head's
/// name, shape and dtype, no weights, no version name (LmHeads::Declare).
inline constexpr char kDeclaredOrigin[] = "declared";

/// True for a declared head's placeholder (never loaded by a worker, never
/// bound to a request).
inline bool IsDeclaredPlaceholder(const LmHeadVersion& v) { return v.origin == kDeclaredOrigin; }

/// Parses "NAME=VxH:DTYPE" (e.g. "policy=151936x4096:bf16"; DTYPE bf16,
/// f16 or f32 in any case) into the placeholder LmHeads::Declare takes:
/// tensor lm_head.weight, transform identity, bytes_per_worker of the
/// largest of `workers` slices. INVALID_ARGUMENT naming --lm-head-declare
/// and what is wrong (the name's rule, V or H not a positive integer below
/// 2^31, an unknown dtype).
absl::StatusOr<LmHeadVersion> ParseDeclaredLmHead(const std::string& arg, int workers);

}  // namespace logprob
