// Scores one WorkItem (a shard of a request) on the CPU backend.
#pragma once

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.pb.h"
#include "worker/communicator.h"

namespace logprob {

/// Rows per collective round in the vocab-parallel layout.
constexpr int64_t kVocabParallelChunkRows = 128;

/// Scores `item` and returns the rows this rank owns:
/// - TOKEN_PARALLEL: every row of the item (whole rows; `comm` unused);
/// - VOCAB_PARALLEL: rows SplitRange(num_rows, comm.size(), comm.rank()),
///   after one all-gather of packed partials per chunk of rows (or, with
///   sampling filters, one all-to-all that gives each rank full rows of its
///   own rows, as NeMo-RL `all_to_all_vp2sq`). All ranks must call this with
///   items of the same job in the same order.
/// INVALID_ARGUMENT for an inconsistent item; UNAVAILABLE when a collective
/// fails.
absl::StatusOr<internal::v1::WorkResult> ScoreWorkItem(const internal::v1::WorkItem& item,
                                                       Communicator& comm);

}  // namespace logprob
