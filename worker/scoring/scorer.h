// Scores one WorkItem (a shard of a request): the orchestration (rounds,
// collectives, combination on the host) around a ScoringBackend.
#pragma once

#include <functional>
#include <string_view>

#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// Rows per collective round in the vocab-parallel layout.
constexpr int64_t kVocabParallelChunkRows = 128;

/// Default hidden-states rows each rank contributes per round; a round's
/// logits are about chunk_tokens * W * V / W floats, whatever the request's T.
constexpr int64_t kDefaultHiddenChunkTokens = 128;

/// Scores `item` and returns the rows this rank owns:
/// - TOKEN_PARALLEL: every row of the item (whole rows; `comm` unused);
/// - VOCAB_PARALLEL: rows SplitRange(num_rows, comm.size(), comm.rank()),
///   after one all-to-all of packed partials per chunk of rows (or, with
///   sampling filters, one all-to-all that gives each rank full rows of its
///   own rows, as NeMo-RL `all_to_all_vp2sq`);
/// - HIDDEN_STATES: the same rows it was given, SplitRange(num_rows, W, r);
///   per round the ranks all-gather `hidden_chunk_tokens` hidden rows each,
///   multiply them by the backend's lm_head slice (rows
///   SplitRange(V, comm.size(), comm.rank())) and combine as VOCAB_PARALLEL;
///   or, when backend.OnePassHidden(comm) and no sampling filters, one pass:
///   backend.HiddenItemPartials gathers, multiplies and exchanges the whole
///   item on its device (CUDA), and this rank combines its rows' records.
/// `backend` computes the packed partial records of every block of rows.
/// All ranks must call this with items of the same job in the same order.
/// `lm_head`: for HIDDEN_STATES items, this rank's slice of the lm_head
/// version the item names (LmHeadRegistry::Find); FAILED_PRECONDITION for
/// a HIDDEN_STATES item without one.
/// `should_stop` (optional; all ranks must pass one or none) is polled
/// between chunks; collective layouts agree on it with one 1-byte
/// all-gather per chunk so every rank stops after the same chunk.
/// CANCELLED when it said stop.
/// INVALID_ARGUMENT for an inconsistent item; UNAVAILABLE when a collective
/// fails.
absl::StatusOr<internal::v1::WorkResult> ScoreWorkItem(const internal::v1::WorkItem& item, Communicator& comm,
                                                       ScoringBackend& backend,
                                                       int64_t hidden_chunk_tokens = kDefaultHiddenChunkTokens,
                                                       const std::function<bool()>& should_stop = {},
                                                       const LmHeadWeights* lm_head = nullptr);

/// Where an item's payload is: host bytes, or (a CUDA IPC input) device
/// memory of the backend's GPU, which only a backend with
/// OnePassHidden(comm) can score (FAILED_PRECONDITION otherwise).
struct ItemPayload {
  ItemPayload(std::string_view b, bool device = false) : bytes(b), on_device(device) {}  // NOLINT: implicit
  std::string_view bytes;
  bool on_device = false;
};

/// As above, with the item's payload (what its `data` would hold) at
/// `payload` instead, e.g. in a shared memory region
/// (WorkItem.shared_memory) or a client's GPU memory (WorkItem.cuda_ipc).
absl::StatusOr<internal::v1::WorkResult> ScoreWorkItem(const internal::v1::WorkItem& item, ItemPayload payload,
                                                       Communicator& comm, ScoringBackend& backend,
                                                       int64_t hidden_chunk_tokens,
                                                       const std::function<bool()>& should_stop,
                                                       const LmHeadWeights* lm_head = nullptr);

}  // namespace logprob
