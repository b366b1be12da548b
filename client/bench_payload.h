// The synthetic request `logprob-client bench` sends: random logits of a
// given shape and dtype, random targets.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob::client {

/// Shape and element type of the bench's logits (flags --batch, --seq,
/// --packed, --vocab, --dtype).
struct BenchShape {
  int64_t batch = 4;          // B: sequences
  int64_t seq = 512;          // S: tokens per sequence, padded layout [B, S, V]
  int64_t packed_tokens = 0;  // T > 0: packed layout [T, V], B sequences split by cu_seqlens
  int64_t vocab = 32000;      // V (hidden mode: the server's lm_head V)
  v1::DType dtype = v1::BF16;
  int64_t hidden = 0;  // H > 0: `hidden_states` [.., H] instead of logits (--hidden-size)
};

/// Width of a row of the scored input: H in hidden mode, else V.
inline int64_t RowWidth(const BenchShape& s) { return s.hidden > 0 ? s.hidden : s.vocab; }

/// Token rows of one request: B * S padded, T packed.
int64_t ShapeTokens(const BenchShape& shape);

/// Checks `shape` before anything is allocated. INVALID_ARGUMENT naming
/// the flag: B, S, V, H or T not positive, T < B, a dtype other than F32,
/// BF16, F16, or logits (hidden states) of 2 GiB or more.
absl::Status ValidateBenchShape(const BenchShape& shape);

/// A request with id `id` and `options`: `logits` [B, S, V] or [T, V]
/// (hidden mode: `hidden_states` [B, S, H] or [T, H]) of uniform values in
/// [-8, 8) (hidden mode: [-1, 1)) (a fixed-seed 1 MiB pattern repeated; the
/// kernels' cost does not depend on the values), `input_ids` I64 uniform
/// in [0, V), and for packed shapes `cu_seqlens` I64 [B + 1] splitting T
/// into B sequences whose lengths differ by at most one.
/// Errors: those of ValidateBenchShape.
absl::StatusOr<v1::ScoreRequest> BuildBenchRequest(const BenchShape& shape, const v1::ScoreOptions& options,
                                                   const std::string& id);

}  // namespace logprob::client
