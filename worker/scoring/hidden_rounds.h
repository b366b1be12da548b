// The rounds of a collective work item, shared by the forward's scorer
// (worker/scoring/scorer.cc) and the lm_head's backward
// (worker/gradients/backward_item.cc): which rows each rank has in a round,
// one round's hidden rows gathered from every rank, and the ranks' agreement
// to stop after the same round.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace logprob {

/// The rows of one collective round, grouped by the rank that finalises
/// them: rank q's rows are global rows [first[q], first[q] + count[q]),
/// stored after those of ranks < q in the round's buffers.
struct RoundRows {
  std::vector<int64_t> first, count;
  explicit RoundRows(int W) : first(W, 0), count(W, 0) {}
  int64_t total() const {
    int64_t n = 0;
    for (int64_t c : count) n += c;
    return n;
  }
};

/// Rows of the largest rank's share of `n` item rows over `W` ranks
/// (SplitRange): a HIDDEN_STATES item's rounds cover [0, this).
int64_t LargestShare(int64_t n, int W);

/// Round `l0` of a HIDDEN_STATES item of `n` rows, each rank holding rows
/// SplitRange(n, W, rank) (`own`: this rank's, `row_bytes` each) and adding
/// up to `per_round` of them: one all-gather, after which `gathered` holds
/// the round's rows of every rank packed in rank order (its first
/// RoundRows::total() rows; `send` is scratch). Every rank calls it with the
/// same n, l0 and per_round. The collective's error when it fails.
absl::StatusOr<RoundRows> GatherHiddenRound(Communicator& comm, std::string_view own, size_t row_bytes, int64_t n,
                                            int64_t l0, int64_t per_round, std::vector<char>* send,
                                            std::vector<char>* gathered);

/// CANCELLED: the request was cancelled or its deadline passed.
absl::Status Stopped();

/// Collective layouts: every rank says whether `should_stop` (may be empty:
/// never; all ranks pass one or none) says stop (one byte, all-gathered),
/// so all stop after the same round. OK to go on; Stopped() or the
/// collective's error otherwise.
absl::Status AgreeToGoOn(Communicator& comm, const std::function<bool()>& should_stop);

}  // namespace logprob
