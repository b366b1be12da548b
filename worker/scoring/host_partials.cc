#include "worker/scoring/host_partials.h"

#include <vector>

namespace logprob {

kernels::SliceRow HostSliceRow(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                               int64_t i) {
  kernels::SliceRow r;
  r.logits = static_cast<const char*>(block.data) + static_cast<size_t>(i * block.len) * DTypeSize(block.dtype);
  r.target = rows.targets[i];
  r.gather_ids = spec.gather_k ? rows.gather_ids + i * spec.gather_k : nullptr;
  if (rows.mask_begin != nullptr && rows.mask_begin[i] >= 0) {
    // A masked row with no id in this slice keeps nothing here: a non-null
    // empty list (the item's ids may then be empty, with no data pointer).
    static const int32_t kNone[1] = {0};
    r.keep_count = rows.mask_end[i] - rows.mask_begin[i];
    r.keep_ids = r.keep_count > 0 ? rows.mask_ids + rows.mask_begin[i] : kNone;
  }
  return r;
}

void HostSlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                       uint32_t* records) {
  std::vector<float> scratch(kernels::kPartialScratchFloats);
  const size_t words = kernels::PartialWords(spec);
  for (int64_t i = 0; i < rows.count; ++i)
    kernels::ComputePartial(block.dtype, HostSliceRow(block, rows, spec, i), block.vocab_begin, block.len, spec,
                            records + i * words, scratch.data());
}

}  // namespace logprob
