#include "worker/scoring/backward_pass.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/row_stats.h"

namespace logprob {

absl::Status RunBackwardPass(const BackwardPassRows& in, SliceBackward& backward, int64_t vocab_size,
                             Communicator& comm, float* grad_hidden, float* grad_weight, float* grad_bias,
                             float* token_logprobs, float* entropy_out) {
  if (in.rows < 0 || in.round_rows <= 0)
    return absl::InvalidArgumentError(absl::StrCat("backward: rows ", in.rows, ", round_rows ", in.round_rows));
  if (in.rows > 0 && (in.hidden == nullptr || grad_hidden == nullptr))
    return absl::InvalidArgumentError("backward: null hidden states or dL/dh buffer");
  const int64_t H = backward.hidden_size();
  const int W = comm.size();
  kernels::StatsSpec spec;
  spec.temperature = backward.temperature();
  spec.entropy = true;  // the forward's entropy output: the same records, the same combine
  spec.vocab_size = vocab_size;
  const size_t words = kernels::PartialWords(spec);
  const size_t hidden_row_bytes = static_cast<size_t>(H) * DTypeSize(in.hidden_dtype);
  std::vector<float> lse, entropy;
  std::vector<uint32_t> mine, all;
  std::vector<const uint32_t*> ranks(static_cast<size_t>(W));
  for (int64_t r0 = 0; r0 < in.rows; r0 += in.round_rows) {
    const int64_t m = std::min(in.round_rows, in.rows - r0);
    const char* h = static_cast<const char*>(in.hidden) + r0 * hidden_row_bytes;
    // The round's logits on this slice, as the forward computes them, and
    // their partial records; every slice's records to every worker.
    mine.assign(static_cast<size_t>(m) * words, 0);
    LOGPROB_RETURN_IF_ERROR(
        backward.Records(in.hidden_dtype, h, m, in.targets != nullptr ? in.targets + r0 : nullptr, spec, mine.data()));
    all.resize(mine.size() * static_cast<size_t>(W));
    LOGPROB_RETURN_IF_ERROR(comm.AllGather(mine.data(), mine.size() * sizeof(uint32_t), all.data()));
    lse.resize(static_cast<size_t>(m));
    entropy.resize(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) {
      for (int q = 0; q < W; ++q) ranks[q] = all.data() + (static_cast<size_t>(q) * m + i) * words;
      kernels::RowOutput out;
      out.logsumexp = &lse[i];
      out.entropy = &entropy[i];
      if (token_logprobs != nullptr) out.token_logprob = token_logprobs + r0 + i;
      const bool has_target = in.targets != nullptr && in.targets[r0 + i] >= 0;
      kernels::CombinePartials(ranks.data(), W, spec, has_target, out);
      if (entropy_out != nullptr) entropy_out[r0 + i] = entropy[i];
    }
    kernels::BackwardRows rows;
    rows.targets = in.targets != nullptr ? in.targets + r0 : nullptr;
    rows.lse = lse.data();
    rows.entropy = entropy.data();
    rows.grad_logprobs = in.grad_logprobs != nullptr ? in.grad_logprobs + r0 : nullptr;
    rows.grad_entropy = in.grad_entropy != nullptr ? in.grad_entropy + r0 : nullptr;
    LOGPROB_RETURN_IF_ERROR(backward.Gradients(rows, grad_hidden + r0 * H, grad_weight, grad_bias));
  }
  return absl::OkStatus();
}

}  // namespace logprob
