// Locating a model's output projection (`lm_head.weight`, shape [V, H]) in
// a Hugging Face safetensors checkpoint, and reading row slices of it.
//
// A checkpoint is a single `*.safetensors` file or a sharded one described
// by `model.safetensors.index.json` ({"weight_map": {tensor: file}}).
// Only headers are parsed here; weights are read later, one vocabulary
// slice (row range) per worker, so no process ever holds the whole matrix
// unless it owns all of it.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace logprob {

/// Tensor names tried, in order, when --lm-head names no tensor.
inline constexpr const char* kLmHeadTensor = "lm_head.weight";
/// Fallback for models with tied input/output embeddings.
inline constexpr const char* kTiedEmbeddingTensor = "model.embed_tokens.weight";

/// Where the lm_head weight lives. Row v (token id v) is H contiguous
/// elements of `dtype` at file offset data_offset + v * H * DTypeSize(dtype).
struct LmHeadSource {
  std::string file;                     // safetensors file holding the tensor
  std::string tensor;                   // tensor name inside `file`
  DType dtype = v1::DTYPE_UNSPECIFIED;  // F32, BF16 or F16
  int64_t vocab_size = 0;               // V: rows
  int64_t hidden_size = 0;              // H: columns
  uint64_t data_offset = 0;             // absolute byte offset of element [0, 0]
  bool tied_embeddings = false;         // tensor is kTiedEmbeddingTensor (fallback or named)
};

/// Resolves the --lm-head argument "PATH[:TENSOR]".
/// PATH is a .safetensors file, a sharded checkpoint's index (any file
/// ending in ".json", e.g. model.safetensors.index.json), or a directory
/// holding model.safetensors.index.json or model.safetensors (the index is
/// preferred). Shard names in the index are relative to its directory and
/// may lead outside it, but must exist. If the whole argument names an
/// existing file or directory it is taken as PATH; otherwise the text
/// after the last ':' is TENSOR (which must not be empty). Without TENSOR,
/// kLmHeadTensor is used, falling back to kTiedEmbeddingTensor
/// (tied_embeddings = true) when the checkpoint has no lm_head; a named
/// TENSOR has no fallback. Only headers are read.
/// Errors: NOT_FOUND (no such file, directory or shard, or the tensor is
/// in no file; the message lists the names tried and the file searched),
/// INVALID_ARGUMENT (malformed safetensors or index JSON, an empty TENSOR,
/// a tensor that is not 2-D [V, H] with V, H > 0, a dtype other than F32,
/// BF16 or F16).
absl::StatusOr<LmHeadSource> ResolveLmHead(const std::string& arg);

/// Reads rows [row_begin, row_end) of the weight into `out`
/// ((row_end - row_begin) * H elements of source.dtype, row-major) with
/// positioned reads of the file: memory is only the slice.
/// An empty range (row_begin == row_end) reads nothing and succeeds.
/// INVALID_ARGUMENT for a range outside [0, V] or with row_begin >
/// row_end; NOT_FOUND when the file cannot be opened; DATA_LOSS when it is
/// shorter than the header says or a read fails.
absl::Status ReadLmHeadRows(const LmHeadSource& source, int64_t row_begin, int64_t row_end, void* out);

}  // namespace logprob
