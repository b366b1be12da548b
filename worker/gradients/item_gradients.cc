#include "worker/gradients/item_gradients.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace logprob {

absl::Status SumSharesToOwners(Communicator& comm, const std::vector<int64_t>& count, int64_t H, const float* share,
                               std::vector<float>* recv, float* out) {
  const int W = comm.size(), me = comm.rank();
  const int64_t mine = count[me];
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  for (int q = 0; q < W; ++q) {
    send_bytes[q] = count[q] * H * static_cast<int64_t>(sizeof(float));
    recv_bytes[q] = mine * H * static_cast<int64_t>(sizeof(float));
  }
  recv->resize(static_cast<size_t>(W * mine * H));
  LOGPROB_RETURN_IF_ERROR(comm.AllToAllV(share, send_bytes, recv->data(), recv_bytes));
  for (int64_t k = 0; k < mine * H; ++k) {
    float s = 0.0f;
    for (int q = 0; q < W; ++q) s += (*recv)[static_cast<size_t>(q * mine * H + k)];
    out[k] = s;
  }
  return absl::OkStatus();
}

absl::Status AddToStepAgreed(HeadGradientSteps& steps, Communicator& comm, const std::string& step,
                             const std::string& head, const std::string& version, int64_t rows, int64_t hidden_size,
                             bool bias, int64_t tokens, const ItemRounds& rounds) {
  if (step.empty()) return rounds.run(nullptr, nullptr);
  // Every rank's step must take the item before any adds to it: the ranks
  // that opened it agree (one flag each) with those that refused it.
  bool entered = false;
  const absl::Status added = steps.Accumulate(
      step, head, version, rows, hidden_size, bias, tokens, [&](HeadGradientSums& sums) -> absl::Status {
        entered = true;
        const absl::StatusOr<int> refused = FirstRankFlagged(comm, false);
        if (!refused.ok()) return HeadGradientSteps::NothingAdded(refused.status());
        if (*refused >= 0)
          return HeadGradientSteps::NothingAdded(absl::AbortedError(
              absl::StrCat("gradient step '", step, "': worker ", *refused,
                           " refused this item (its error says why); nothing was added on any worker")));
        const absl::Status ran = rounds.run(sums.weight.data(), sums.bias.empty() ? nullptr : sums.bias.data());
        // Stopped or failed before the first round added: the step is kept.
        return ran.ok() || rounds.added() ? ran : HeadGradientSteps::NothingAdded(ran);
      });
  if (!entered) {
    (void)FirstRankFlagged(comm, true);  // the others learn this rank refused
    return added;
  }
  return added;
}

}  // namespace logprob
