// Scores one WorkItem (a shard of a request) on the CPU backend.
#pragma once

#include <functional>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.pb.h"
#include "worker/communicator.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob {

/// Rows per collective round in the vocab-parallel layout.
constexpr int64_t kVocabParallelChunkRows = 128;

/// What a worker needs for HIDDEN_STATES items.
struct HiddenScoring {
  /// This rank's lm_head slice, rows SplitRange(V, comm.size(), comm.rank()).
  kernels::LmHeadGemm* gemm = nullptr;
  /// Hidden-states rows each rank contributes per round; a round's logits
  /// buffer is about chunk_tokens * V floats, whatever the request's T.
  int64_t chunk_tokens = 128;
};

/// Scores `item` and returns the rows this rank owns:
/// - TOKEN_PARALLEL: every row of the item (whole rows; `comm` unused);
/// - VOCAB_PARALLEL: rows SplitRange(num_rows, comm.size(), comm.rank()),
///   after one all-to-all of packed partials per chunk of rows (or, with
///   sampling filters, one all-to-all that gives each rank full rows of its
///   own rows, as NeMo-RL `all_to_all_vp2sq`);
/// - HIDDEN_STATES: the same rows it was given, SplitRange(num_rows, W, r);
///   per round the ranks all-gather chunk_tokens hidden rows each, run
///   `hidden->gemm` on them and combine as VOCAB_PARALLEL.
/// All ranks must call this with items of the same job in the same order.
/// FAILED_PRECONDITION for a HIDDEN_STATES item without `hidden`.
/// `should_stop` (optional; all ranks must pass one or none) is polled
/// between chunks; collective layouts agree on it with one 1-byte
/// all-gather per chunk so every rank stops after the same chunk.
/// CANCELLED when it said stop.
/// INVALID_ARGUMENT for an inconsistent item; UNAVAILABLE when a collective
/// fails.
absl::StatusOr<internal::v1::WorkResult> ScoreWorkItem(const internal::v1::WorkItem& item,
                                                       Communicator& comm,
                                                       const HiddenScoring* hidden = nullptr,
                                                       const std::function<bool()>& should_stop = {});

}  // namespace logprob
