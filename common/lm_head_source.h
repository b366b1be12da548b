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
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/confined_file.h"
#include "common/dtype.h"
#include "common/lm_head_transform.h"

namespace logprob {

/// Tensor names tried, in order, when --lm-head names no tensor.
inline constexpr const char* kLmHeadTensor = "lm_head.weight";
/// Fallback for models with tied input/output embeddings.
inline constexpr const char* kTiedEmbeddingTensor = "model.embed_tokens.weight";

/// The file holding a checkpoint's config (its head's logit scalars).
inline constexpr const char* kModelConfigFile = "config.json";

/// Where a head's bias [V] lives: element v at file offset data_offset +
/// v * DTypeSize(dtype). `file` empty: the head has no bias.
struct LmHeadBiasSource {
  std::string file;
  std::string tensor;                   // e.g. "lm_head.bias"
  DType dtype = v1::DTYPE_UNSPECIFIED;  // F32, BF16 or F16
  uint64_t data_offset = 0;
  bool operator==(const LmHeadBiasSource& o) const {
    return file == o.file && tensor == o.tensor && dtype == o.dtype && data_offset == o.data_offset;
  }
};

/// A head's scalars given on logprob-server's command line
/// (--lm-head-logit-scale, --lm-head-softcap); unset: not given.
struct LmHeadScalarFlags {
  std::optional<double> logit_scale;  // > 0
  std::optional<double> softcap;      // >= 0 (0: none)
};

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
  /// What the head does to h W^T (common/lm_head_transform.h); has_bias
  /// exactly when bias.file is set.
  LmHeadTransform transform;
  LmHeadBiasSource bias;
  /// The config.json the scalars were read from ("" when none was).
  std::string config_file;
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
/// TENSOR has no fallback. Only headers (and config.json) are read.
///
/// The head's transform: its bias is the tensor "lm_head.bias" (for a
/// TENSOR "X.weight" other than the tied embedding: "X.bias") in the same
/// file, or where a sharded index's weight_map puts it; it must be 1-D [V]
/// of F32, BF16 or F16. When PATH is a directory holding config.json, the
/// scalars come from it (LmHeadScalarsFromConfig: its errors refuse the
/// head) and a flag in `flags` must agree with it (INVALID_ARGUMENT
/// naming both); else they are the flags' (absent: scale 1, no softcap).
/// A config with "lm_head_bias": true and no bias tensor is
/// INVALID_ARGUMENT.
/// Errors: NOT_FOUND (no such file, directory or shard, or the tensor is
/// in no file; the message lists the names tried and the file searched),
/// INVALID_ARGUMENT (malformed safetensors or index JSON, an empty TENSOR,
/// a tensor that is not 2-D [V, H] with V, H > 0, a dtype other than F32,
/// BF16 or F16).
absl::StatusOr<LmHeadSource> ResolveLmHead(const std::string& arg, const LmHeadScalarFlags& flags = {});

/// How a head's files are opened: `path` as the resolver names it (the
/// argument's PATH, or PATH joined with an index's shard name or a
/// directory's file name); a directory only when `dir_ok`. OpenTrusted
/// for an operator's --lm-head; OpenBeneath a directory for a client's.
using LmHeadOpener = std::function<absl::StatusOr<OpenedFile>(const std::string& path, bool dir_ok)>;

/// A resolved head with the file holding its weight still open.
struct OpenedLmHead {
  LmHeadSource source;
  std::shared_ptr<UniqueFd> weight;  // source.file, opened once: read it through this
};

/// ResolveLmHead of PATH `path` and TENSOR `tensor` ("" : the default
/// names), every file (index, shards, config.json) opened with `open`
/// exactly once and read only through the descriptor it gave: a shard is
/// opened by `open` before any byte of it is read. Errors as ResolveLmHead
/// and `open`'s. `max_metadata_bytes` bounds what is read into memory of
/// each file (a safetensors header, an index or config.json: at most 100
/// and 64 MiB): larger is INVALID_ARGUMENT. Thread-safe when `open` is.
absl::StatusOr<OpenedLmHead> ResolveLmHeadWith(const LmHeadOpener& open, const std::string& path,
                                               const std::string& tensor, const LmHeadScalarFlags& flags = {},
                                               uint64_t max_metadata_bytes = UINT64_MAX);

/// Reads rows [row_begin, row_end) of the weight into `out`
/// ((row_end - row_begin) * H elements of source.dtype, row-major) with
/// positioned reads of the file: memory is only the slice.
/// An empty range (row_begin == row_end) reads nothing and succeeds.
/// INVALID_ARGUMENT for a range outside [0, V] or with row_begin >
/// row_end; NOT_FOUND when the file cannot be opened (opened once,
/// non-blocking: FAILED_PRECONDITION when it is not a regular file); DATA_LOSS when it is
/// shorter than the header says or a read fails.
absl::Status ReadLmHeadRows(const LmHeadSource& source, int64_t row_begin, int64_t row_end, void* out);

/// ReadLmHeadRows through `fd`, the open source.file (OpenedLmHead::weight):
/// nothing is opened by name. Thread-safe.
absl::Status ReadLmHeadRows(int fd, const LmHeadSource& source, int64_t row_begin, int64_t row_end, void* out);

/// Rows [row_begin, row_end) of the weight in pieces of whole rows, each at
/// most `piece_bytes` (one row at least), for streaming a version out (to
/// a worker, to a peer): the file is opened once, each piece is read into
/// `*piece` (resized to its bytes) and handed to `emit(first_row)`. An
/// empty range emits nothing. Returns the first error: ReadLmHeadRows's,
/// or emit's (e.g. CANCELLED when the reader went away).
absl::Status ForEachLmHeadRowPiece(const LmHeadSource& source, int64_t row_begin, int64_t row_end, int64_t piece_bytes,
                                   std::string* piece, const std::function<absl::Status(int64_t first_row)>& emit);

/// Reads elements [row_begin, row_end) of the head's bias (source.bias),
/// widened to f32, into `out` (row_end - row_begin floats). Errors as
/// ReadLmHeadRows; FAILED_PRECONDITION when the head has no bias.
absl::Status ReadLmHeadBias(const LmHeadSource& source, int64_t row_begin, int64_t row_end, float* out);

}  // namespace logprob
