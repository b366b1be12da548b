// Validation of a public ScoreRequest into a ScoreJob: the list of rows to
// score, each with its target and output position (docs/SPEC.md
// "Inputs" and "Outputs").
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob {

class RegionReader;  // server/client_regions.h

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
/// order; `rows` point into the request, which must outlive the job.
struct ScoreJob {
  bool hidden = false;                  // rows are hidden states, not logits
  DType dtype = v1::DTYPE_UNSPECIFIED;  // of the logits or hidden states
  int64_t vocab_size = 0;               // V
  int64_t hidden_size = 0;              // H (hidden only)
  size_t row_bytes = 0;                 // (V or H) * sizeof(dtype)
  std::vector<const char*> rows;        // input row (row_bytes bytes) of each scored row
  std::vector<int64_t> targets;         // global target id, -1 = ignored
  std::vector<int64_t> out_pos;         // flat output position of each row
  int gather_k = 0;
  std::vector<int64_t> gather_ids;  // [rows, gather_k]
  std::vector<int64_t> out_shape;   // leading output shape: [B, S'] or [T']
  v1::ScoreOptions options;         // normalised: temperature, top_p, ignore_index set
  /// Rows that lie in a client's shared-memory region (server/shared_inputs.h):
  /// (first row, reader) segments in row order; the rows from a segment's
  /// first row up to the next segment's are read through its reader (a null
  /// reader: in memory). Empty: every row is in memory. A region's rows
  /// must be copied with CopyRows / CopyRowSlice, never dereferenced.
  struct RowSource {
    int64_t first_row = 0;
    std::shared_ptr<const RegionReader> reader;
  };
  std::vector<RowSource> row_sources;
  /// Hidden states in a same-host client's CUDA allocation
  /// (server/cuda_ipc_inputs.h): the rows are then every input row in order
  /// (unscored ones with out_pos -1), at placeholder addresses nothing may
  /// read; the planner sends each worker the allocation's handle and its
  /// byte range instead of bytes, and such a job is never batched with others.
  struct CudaIpc {
    std::string handle;  // 64-byte cudaIpcMemHandle_t of the allocation
    int64_t offset = 0;  // bytes from the allocation's base to row 0
    std::string device_uuid;
  };
  std::optional<CudaIpc> cuda_ipc;

  int64_t num_rows() const { return static_cast<int64_t>(rows.size()); }
  int64_t num_outputs() const;  // product of out_shape
};

/// Validates `req` and builds its job. Errors are INVALID_ARGUMENT with a
/// message naming the field (and for targets and gather ids, the sequence
/// and position): unknown or duplicate tensor, wrong dtype, shape mismatch,
/// data size not matching shape, bad cu_seqlens / seq_lens, a target
/// outside [0, V) that is not ignore_index, out-of-range options, both or
/// neither of logits and hidden_states, hidden_states whose H is not the
/// lm_head's. FAILED_PRECONDITION for hidden_states when `lm_head` has no
/// shape (the server was started without --lm-head).
/// `data` (when given) holds each input's bytes by index instead of its
/// `data` field (shared-memory inputs, server/shared_inputs.h): only the
/// integer tensors' bytes are read; the rows point into the logits' or
/// hidden states' view.
absl::StatusOr<ScoreJob> BuildScoreJob(const v1::ScoreRequest& req, const RequestLimits& limits,
                                       const LmHeadShape& lm_head = {},
                                       const std::vector<std::string_view>* data = nullptr);

/// Copies the input rows [begin, end) of `job` to `out`, packed (row_bytes
/// each): from memory, or through their RegionReader (one read per run of
/// rows that are consecutive in one source). False if a region could not
/// be read (that part of `out` is zero-filled; the reader keeps the error).
bool CopyRows(const ScoreJob& job, int64_t begin, int64_t end, char* out);
/// Copies bytes [offset, offset + n) of input row `row` to `dst` (same
/// sources and errors as CopyRows).
bool CopyRowSlice(const ScoreJob& job, int64_t row, size_t offset, size_t n, char* dst);

}  // namespace logprob
