// Reading and writing Hugging Face safetensors files: an 8-byte
// little-endian header length N, N bytes of JSON header
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {str: str}}), then the raw tensor bytes.
// Format: https://huggingface.co/docs/safetensors
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob {

/// The tensors (in file order of their data) and metadata of one file.
struct SafetensorsFile {
  std::vector<v1::Tensor> tensors;
  std::map<std::string, std::string> metadata;

  /// The tensor called `name`, or nullptr.
  const v1::Tensor* Find(const std::string& name) const;
};

/// Parses safetensors bytes. Errors (INVALID_ARGUMENT) name what is wrong:
/// a short file, a header that is not JSON, an unsupported dtype, data
/// offsets that do not match the shape or fall outside the file.
absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes);

/// Reads and parses `path` (mapped read-only, so each tensor's bytes are
/// copied once, from the page cache into its Tensor). NOT_FOUND when the
/// file cannot be opened.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

/// A safetensors file mapped read-only: its tensors' names, dtypes and
/// shapes (data empty) and views of their bytes in the mapping, so a
/// sender can send the bytes without copying them. Move-only; the views
/// are valid while it lives.
class MappedSafetensors {
 public:
  /// Maps and parses `path`. Errors as ReadSafetensors.
  static absl::StatusOr<MappedSafetensors> Open(const std::string& path);
  MappedSafetensors(MappedSafetensors&& o) noexcept;
  MappedSafetensors& operator=(MappedSafetensors&&) = delete;
  ~MappedSafetensors();

  /// The tensors, their data empty (BuildScoreRequest may move them out).
  SafetensorsFile& file() { return file_; }
  /// The bytes of the tensor called `name`; empty when there is none.
  std::string_view data(const std::string& name) const;

 private:
  MappedSafetensors() = default;
  SafetensorsFile file_;
  std::map<std::string, std::string_view> data_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::string copy_;  // the bytes, when the file cannot be mapped (e.g. a pipe)
};

/// One tensor of a safetensors header: where its bytes are, not the bytes.
struct SafetensorsEntry {
  std::string name;
  DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;  // row-major dims; empty for a scalar
  uint64_t begin = 0;          // byte range [begin, end) relative to the
  uint64_t end = 0;            // start of the data section
};

/// A validated safetensors header: entries are as ParseSafetensors checks
/// tensors (supported dtype, end - begin = numel * DTypeSize, inside the
/// file), in file order of their data.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // absolute file offset of the data section: 8 + N

  /// The entry called `name`, or nullptr.
  const SafetensorsEntry* Find(const std::string& name) const;
};

/// Reads only the header of `path` (the 8-byte length and the JSON; the
/// file size bounds the data offsets), so multi-GB files cost two small
/// reads. Errors: NOT_FOUND when the file cannot be opened,
/// INVALID_ARGUMENT "<path>: malformed safetensors: ..." as ParseSafetensors,
/// DATA_LOSS when reading fails.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path);

/// ReadSafetensorsHeader of the open regular file `fd` (`size` bytes), read
/// only through it (positioned reads); errors name it `name`. A malformed
/// file's error never prints a number read from it (its header length):
/// it may be any file, and its bytes are not the caller's to see.
/// `max_header_bytes`: a header longer is refused as not a safetensors
/// file (at most the format's 100 MiB).
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(int fd, uint64_t size, const std::string& name,
                                                        uint64_t max_header_bytes = UINT64_MAX);

/// Serialises tensors and metadata to safetensors bytes.
std::string SerializeSafetensors(const std::vector<v1::Tensor>& tensors,
                                 const std::map<std::string, std::string>& metadata = {});

/// Writes a safetensors file (via a temporary file and rename).
absl::Status WriteSafetensors(const std::string& path, const std::vector<v1::Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace logprob
