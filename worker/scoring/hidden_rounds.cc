#include "worker/scoring/hidden_rounds.h"

#include <algorithm>
#include <cstring>

#include "common/partition.h"
#include "common/status_macros.h"

namespace logprob {

int64_t LargestShare(int64_t n, int W) { return SplitRange(n, W, 0).second; }

absl::StatusOr<RoundRows> GatherHiddenRound(Communicator& comm, std::string_view own, size_t row_bytes, int64_t n,
                                            int64_t l0, int64_t per_round, std::vector<char>* send,
                                            std::vector<char>* gathered) {
  const int W = comm.size(), me = comm.rank();
  const int64_t c = std::min(per_round, LargestShare(n, W) - l0);  // padded rows per rank this round
  RoundRows rows(W);
  for (int q = 0; q < W; ++q) {
    const auto [ob, oe] = SplitRange(n, W, q);
    rows.first[q] = ob + l0;
    rows.count[q] = std::clamp<int64_t>(oe - ob - l0, 0, c);
  }
  send->assign(c * row_bytes, 0);
  std::copy_n(own.data() + l0 * row_bytes, rows.count[me] * row_bytes, send->data());
  gathered->resize(W * c * row_bytes);
  LOGPROB_RETURN_IF_ERROR(comm.AllGather(send->data(), send->size(), gathered->data()));
  // Drop the padding: rank q's rows follow rank q-1's.
  int64_t packed = 0;
  for (int q = 0; q < W; ++q) {
    std::memmove(gathered->data() + packed * row_bytes, gathered->data() + q * c * row_bytes,
                 rows.count[q] * row_bytes);
    packed += rows.count[q];
  }
  return rows;
}

absl::Status Stopped() { return absl::CancelledError("stopped: the request was cancelled or its deadline passed"); }

absl::Status AgreeToGoOn(Communicator& comm, const std::function<bool()>& should_stop) {
  if (!should_stop) return absl::OkStatus();
  LOGPROB_ASSIGN_OR_RETURN(const int stopping, FirstRankFlagged(comm, should_stop()));
  return stopping >= 0 ? Stopped() : absl::OkStatus();
}

}  // namespace logprob
