#include "common/lm_head_source.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace logprob {
namespace {

namespace fs = std::filesystem;

constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";

bool Exists(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

// PATH as a file: a directory becomes its index, else its model.safetensors.
absl::StatusOr<std::string> CheckpointFile(const std::string& path) {
  if (!Exists(path)) return absl::NotFoundError(absl::StrCat("lm_head: no such file or directory: ", path));
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  for (const char* name : {kIndexFile, kSingleFile})
    if (Exists(fs::path(path) / name)) return (fs::path(path) / name).string();
  return absl::NotFoundError(
      absl::StrCat("lm_head: directory ", path, " holds neither ", kIndexFile, " nor ", kSingleFile));
}

// The "weight_map" object of a sharded checkpoint's index file.
absl::StatusOr<nlohmann::json> ReadWeightMap(const std::string& index) {
  std::ifstream in(index, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", index));
  std::ostringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    return absl::InvalidArgumentError(
        absl::StrCat(index, ": not a safetensors index (a JSON object with a \"weight_map\" object)"));
  return j["weight_map"];
}

// Checks that `e` (of `file`) is a 2-D float matrix and locates it.
absl::StatusOr<LmHeadSource> FromEntry(const std::string& file, const SafetensorsHeader& header,
                                       const SafetensorsEntry& e) {
  if (e.shape.size() != 2 || e.shape[0] <= 0 || e.shape[1] <= 0)
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensor \"", e.name, "\" has shape [",
                                                   absl::StrJoin(e.shape, ", "), "], not [vocab, hidden]"));
  if (!IsFloatDType(e.dtype))
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": tensor \"", e.name, "\" is ", DTypeName(e.dtype), ", not F32, BF16 or F16"));
  LmHeadSource s;
  s.file = file;
  s.tensor = e.name;
  s.dtype = e.dtype;
  s.vocab_size = e.shape[0];
  s.hidden_size = e.shape[1];
  s.data_offset = header.data_start + e.begin;
  s.tied_embeddings = e.name == kTiedEmbeddingTensor;
  return s;
}

}  // namespace

absl::StatusOr<LmHeadSource> ResolveLmHead(const std::string& arg) {
  std::string path = arg, tensor;
  if (const size_t colon = arg.rfind(':'); !Exists(arg) && colon != std::string::npos) {
    path = arg.substr(0, colon);
    tensor = arg.substr(colon + 1);
    if (tensor.empty()) return absl::InvalidArgumentError(absl::StrCat("lm_head: empty tensor name in \"", arg, "\""));
  }
  LOGPROB_ASSIGN_OR_RETURN(const std::string file, CheckpointFile(path));
  const std::vector<std::string> names =
      tensor.empty() ? std::vector<std::string>{kLmHeadTensor, kTiedEmbeddingTensor} : std::vector<std::string>{tensor};

  if (fs::path(file).extension() == ".json") {  // sharded: find the shard, then the tensor in it
    LOGPROB_ASSIGN_OR_RETURN(const nlohmann::json weight_map, ReadWeightMap(file));
    for (const std::string& name : names) {
      auto it = weight_map.find(name);
      if (it == weight_map.end()) continue;
      if (!it->is_string())
        return absl::InvalidArgumentError(absl::StrCat(file, ": weight_map[\"", name, "\"] is not a file name"));
      const std::string shard = (fs::path(file).parent_path() / it->get<std::string>()).string();
      absl::StatusOr<SafetensorsHeader> header = ReadSafetensorsHeader(shard);
      if (!header.ok())
        return absl::Status(header.status().code(),
                            absl::StrCat(file, ": shard of \"", name, "\": ", header.status().message()));
      const SafetensorsEntry* e = header->Find(name);
      if (e == nullptr)
        return absl::NotFoundError(
            absl::StrCat(file, " puts tensor \"", name, "\" in ", shard, ", which has no such tensor"));
      return FromEntry(shard, *header, *e);
    }
  } else {
    LOGPROB_ASSIGN_OR_RETURN(const SafetensorsHeader header, ReadSafetensorsHeader(file));
    for (const std::string& name : names)
      if (const SafetensorsEntry* e = header.Find(name)) return FromEntry(file, header, *e);
  }
  return absl::NotFoundError(absl::StrCat("lm_head: no tensor \"", absl::StrJoin(names, "\" or \""), "\" in ", file));
}

absl::Status ReadLmHeadRows(const LmHeadSource& source, int64_t row_begin, int64_t row_end, void* out) {
  if (row_begin < 0 || row_begin > row_end || row_end > source.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("lm_head rows [", row_begin, ", ", row_end, ") are outside [0, ",
                                                   source.vocab_size, ") of ", source.file));
  const uint64_t row_bytes = static_cast<uint64_t>(source.hidden_size) * DTypeSize(source.dtype);
  const uint64_t offset = source.data_offset + static_cast<uint64_t>(row_begin) * row_bytes;
  const uint64_t size = static_cast<uint64_t>(row_end - row_begin) * row_bytes;
  if (size == 0) return absl::OkStatus();
  const int fd = ::open(source.file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return absl::NotFoundError(absl::StrCat("cannot open ", source.file, ": ", std::generic_category().message(errno)));
  absl::Status status;
  for (uint64_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, static_cast<char*>(out) + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      status = absl::DataLossError(absl::StrCat(
          source.file, ": ", n == 0 ? std::string("file ends") : std::generic_category().message(errno), " at byte ",
          offset + done, " but lm_head rows [", row_begin, ", ", row_end, ") end at byte ", offset + size));
      break;
    }
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return status;
}

}  // namespace logprob
