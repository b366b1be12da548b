// Validation of a public ScoreRequest into a ScoreJob: the list of rows to
// score, each with its target and output position (docs/SPEC.md
// "Inputs" and "Outputs").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "logprob/v1/logprob.pb.h"
#include "server/core/rollout_mismatch.h"
#include "server/heads/lm_heads.h"
#include "server/inputs/input_source.h"
#include "server/inputs/request_inputs.h"

namespace logprob {

/// Per-request limits enforced by validation.
struct RequestLimits {
  int64_t max_tokens = int64_t{1} << 22;  // rows of logits per request
  int32_t max_topk = 1024;                // K of topk outputs and gathers
};

/// The server's lm_head shape; zeros when it has none.
struct LmHeadShape {
  int64_t vocab_size = 0;   // V
  int64_t hidden_size = 0;  // H
};

/// A validated request. Rows are the scored positions only, in output
/// order (or every input row, for a source whose rules say
/// every_input_row); each is an input row of its segment's source.
struct ScoreJob {
  bool hidden = false;                  // rows are hidden states, not logits
  DType dtype = v1::DTYPE_UNSPECIFIED;  // of the logits or hidden states
  int64_t vocab_size = 0;               // V
  int64_t hidden_size = 0;              // H (hidden only)
  size_t row_bytes = 0;                 // (V or H) * sizeof(dtype)
  /// Input row of each row: bytes [rows[i] * row_bytes, + row_bytes) of
  /// its segment's source. Read them with CopyRows / CopyRowSlice.
  std::vector<int64_t> rows;
  std::vector<int64_t> targets;  // global target id, -1 = ignored
  /// Flat output position of each row; -1: computed but not answered (an
  /// unscored input row of an every_input_row source).
  std::vector<int64_t> out_pos;
  int gather_k = 0;
  std::vector<int64_t> gather_ids;  // [rows, gather_k]
  std::vector<int64_t> out_shape;   // leading output shape: [B, S'] or [T']
  v1::ScoreOptions options;         // normalised: temperature, top_p, ignore_index set
  /// Where the rows' bytes are, in row order: rows from a segment's
  /// first_row up to the next segment's come from its source. A request's
  /// job has one segment; a batch's (ConcatJobs) one per job.
  struct Segment {
    int64_t first_row = 0;
    std::shared_ptr<const InputSource> source;
  };
  std::vector<Segment> segments;
  /// Hidden states: the lm_head version bound at admission (LmHeads::Bind),
  /// which scores every row; kept alive by the job.
  std::shared_ptr<const LmHeadVersion> lm_head;
  /// The request's rollout logprobs and options (input "rollout_logprobs",
  /// server/core/rollout_mismatch.h), or null. They change only the
  /// response: `options` holds no rollout field.
  std::shared_ptr<const RolloutInput> rollout;
  /// Sampling masks (inputs sampling_mask_offsets / sampling_mask_ids,
  /// docs/SPEC.md "Sampling masks"), per row in row order: row i keeps the
  /// global ids mask_ids[mask_offsets[i], mask_offsets[i + 1]) (strictly
  /// ascending); an empty range: no mask. Both empty without masks.
  std::vector<int64_t> mask_offsets;  // [rows + 1]
  std::vector<int32_t> mask_ids;
  bool has_masks() const { return !mask_offsets.empty(); }
  /// Bytes the front-end holds for the sampling masks beyond the request
  /// message while the job runs on `workers` workers: this copy (4 per id,
  /// 8 per row), the work items' (AddMasks: the ids once in all, an
  /// offset and a flag per row in every worker's item) and their
  /// serialized form (at most 5 per id and 11 per row and worker). Counted
  /// with the request's bytes in the admission (ScoringCore::Score), so
  /// that top-p masks of tens of thousands of ids per token stay within
  /// the memory bound (server/app/memory_bound.h). 0 without masks.
  int64_t mask_working_bytes(int workers) const;
  /// The lm_head's backward (input grad_token_logprobs, docs/gradients.md).
  bool backward = false;
  /// Per row in row order: dL/dlogprob (0 where the target is ignored)
  /// and dL/dentropy (empty when the request has no grad_entropy).
  std::vector<float> grad_logprobs, grad_entropy;
  /// The hidden states' leading shape ([B, S] or [T]): grad_hidden_states
  /// is [input_shape, H]; each row's input row is rows[i].
  std::vector<int64_t> input_shape;
  /// Bytes a backward holds beyond its request while it runs: the
  /// workers' dL/dh rows (4 H per row, in the results and their serialized
  /// form) and the answer's grad_hidden_states (4 H per input row, twice:
  /// built, then serialized). 0 for a forward. Counted in the admission
  /// with the request's bytes (ScoringCore::Score).
  int64_t backward_working_bytes() const;

  int64_t num_rows() const { return static_cast<int64_t>(rows.size()); }
  int64_t num_outputs() const;  // product of out_shape
  /// May share a worker batch (every source's rules().batchable).
  bool batchable() const;
  /// The source the workers read themselves (rules().readable_here false;
  /// such a source is the job's only segment), else null.
  const InputSource* referenced_source() const;
  /// OK, or the first error of a source that failed a read (a client that
  /// shrank its shared-memory region while the request was planned).
  absl::Status ReadStatus() const;
};

/// Validates `req` and builds its job. Errors are INVALID_ARGUMENT with a
/// message naming the field (and for targets and gather ids, the sequence
/// and position): unknown or duplicate tensor, wrong dtype, shape mismatch,
/// data size not matching shape, bad cu_seqlens / seq_lens, a target
/// outside [0, V) that is not ignore_index, out-of-range options, a
/// rollout_logprobs not F32 or not shaped like the output or whose value at
/// a scored token is > 0 (CheckRolloutLogprob), a sampling mask that is not
/// CSR over the outputs, has ids unsorted, repeated or outside [0, V), or
/// comes with sampling_top_k / sampling_top_p or is_top1, both or
/// neither of logits and hidden_states, hidden_states whose H is not the
/// lm_head's. FAILED_PRECONDITION for hidden_states when `lm_head` has no
/// shape (the server was started without --lm-head), or when an integer
/// tensor's source cannot be read (InputSource::status).
/// `inputs` (ResolveInputs, server/inputs/request_inputs.h) holds each input's
/// source; null: every tensor's `data` (InlineInputs). The integer tensors
/// are read while validating; the logits' or hidden states' rows are only
/// addressed.
absl::StatusOr<ScoreJob> BuildScoreJob(const v1::ScoreRequest& req, const RequestLimits& limits,
                                       const LmHeadShape& lm_head = {}, const RequestInputs* inputs = nullptr);

/// Makes `job` cover every input row of its source in order (`input_rows`
/// rows), for sources whose rules say every_input_row: rows that are not
/// scored (padding, the last position of a sequence under next_token) get
/// target -1, gather ids 0 and out_pos -1 (BuildResponse drops them).
void ExpandToInputRows(int64_t input_rows, ScoreJob* job);

/// Copies the input rows [begin, end) of `job` to `out`, packed (row_bytes
/// each), with one source Read per run of rows that are consecutive in one
/// source. False if a source could not be read (that part of `out` is
/// zero-filled; the source keeps the error).
bool CopyRows(const ScoreJob& job, int64_t begin, int64_t end, char* out);
/// Copies bytes [offset, offset + n) of input row `row` to `dst` (same
/// sources and errors as CopyRows).
bool CopyRowSlice(const ScoreJob& job, int64_t row, size_t offset, size_t n, char* dst);

}  // namespace logprob
