// Reading and writing Hugging Face safetensors files: an 8-byte
// little-endian header length N, N bytes of JSON header
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {str: str}}), then the raw tensor bytes.
// Format: https://huggingface.co/docs/safetensors
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes);

/// Reads and parses `path`. NOT_FOUND when the file cannot be opened.
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

/// Serialises tensors and metadata to safetensors bytes.
std::string SerializeSafetensors(const std::vector<v1::Tensor>& tensors,
                                 const std::map<std::string, std::string>& metadata = {});

/// Writes a safetensors file (via a temporary file and rename).
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<v1::Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace logprob
