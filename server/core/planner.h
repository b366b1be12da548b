// How a ScoreJob is split across the worker pool.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/shared_memory.h"
#include "logprob/internal/v1/worker.pb.h"
#include "server/core/score_job.h"
#include "server/pool/payload_pool.h"
#include "server/pool/plan.h"

namespace logprob {

/// Layout choice: kAuto picks by cost, the others force a layout.
enum class Parallelism { kAuto, kToken, kVocab };

/// Parses "auto" | "token" | "vocab".
absl::StatusOr<Parallelism> ParseParallelism(const std::string& s);

/// The layout PlanWork gives `job`: HIDDEN_STATES for hidden states;
/// otherwise VOCAB_PARALLEL when forced, or under kAuto when there are
/// fewer rows than workers (and more than one worker); else TOKEN_PARALLEL.
internal::v1::Layout ChooseLayout(const ScoreJob& job, int workers, Parallelism parallelism);

/// Chooses the layout (ChooseLayout) and builds the work items (copying each worker's
/// rows or column slices out of the request).
/// Token-parallel (whole rows, no collective) is chosen when there are at
/// least as many rows as workers: it moves the same bytes and needs no
/// collective. Vocab-parallel (column slices, SplitRange(V, W, r), one
/// collective round per chunk) keeps every worker busy on few long rows.
/// Hidden-states jobs are always HIDDEN_STATES: worker w gets the hidden
/// states of rows SplitRange(n, W, w) and owns lm_head rows
/// SplitRange(V, W, w).
/// With a `payload_pool` (workers on this host) the payloads are written
/// to one region of it (WorkItem.shared_memory) instead of the items'
/// bytes (WorkItem.data); if no region can be had (e.g. /dev/shm full)
/// they go inline. The rows are read from their sources with CopyRows /
/// CopyRowSlice; rows that cannot be read (a client shrank its region) are
/// zero-filled and their source keeps the error, which fails their request
/// (ScoreJob::ReadStatus). A job whose source the workers read themselves
/// (ScoreJob::referenced_source, always HIDDEN_STATES) copies no bytes:
/// worker w's item refers to the byte range of its rows SplitRange(n, W, w)
/// (InputSource::Refer).
Plan PlanWork(const ScoreJob& job, int workers, Parallelism parallelism, uint64_t job_id,
              PayloadPool* payload_pool = nullptr);

}  // namespace logprob
