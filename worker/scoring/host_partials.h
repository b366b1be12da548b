// Partial records of host logits computed with the CPU kernels, sampling
// masks included: the CPU backend's SlicePartials, and every backend's for
// masked rows (docs/SPEC.md "Sampling masks").
#pragma once

#include <cstdint>

#include "worker/kernels/row_stats.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// Row i of `block` and `rows` as the kernels take it (logits, target,
/// gather ids, sampling mask).
kernels::SliceRow HostSliceRow(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                               int64_t i);

/// Records of rows.count rows of the host logits slice `block` computed on
/// this thread with the CPU kernels (kernels::ComputePartial), sampling
/// masks applied: the CPU backend's SlicePartials, and every backend's for
/// masked rows (the GPU kernels have no masks). `records` holds rows.count
/// * PartialWords(spec) words. Thread-safe.
void HostSlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                       uint32_t* records);

}  // namespace logprob
