#include "common/lm_head_source.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string_view>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/confined_file.h"
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

constexpr uint64_t kMaxJsonBytes = uint64_t{64} << 20;  // an index or config.json larger is refused

// `dir`/`name` as the opener names files ("" + name: name).
std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : (fs::path(dir) / name).string();
}

// PATH as an opened file: a directory becomes its index, else its
// model.safetensors. `*file` is the name of the file opened.
absl::StatusOr<OpenedFile> CheckpointFile(const LmHeadOpener& open, const std::string& path, bool* is_dir,
                                          std::string* file) {
  LOGPROB_ASSIGN_OR_RETURN(OpenedFile top, open(path, /*dir_ok=*/true));
  *is_dir = top.is_dir;
  *file = path;
  if (!top.is_dir) return top;
  for (const char* name : {kIndexFile, kSingleFile}) {
    absl::StatusOr<OpenedFile> f = open(Join(path, name), /*dir_ok=*/false);
    if (f.ok() || f.status().code() != absl::StatusCode::kNotFound) {
      *file = Join(path, name);
      return f;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("lm_head: directory ", path, " holds neither ", kIndexFile, " nor ", kSingleFile));
}

// The "weight_map" object of a sharded checkpoint's index file `fd`.
absl::StatusOr<nlohmann::json> ReadWeightMap(int fd, const std::string& index, uint64_t max_bytes) {
  LOGPROB_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(fd, index, std::min(max_bytes, kMaxJsonBytes)));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
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

// A tensor found in a checkpoint: its file, that file's header, its entry.
struct Located {
  std::string file;
  SafetensorsHeader header;
  SafetensorsEntry entry;
  std::shared_ptr<UniqueFd> fd;  // `file`, open
};

// Tensor `name` of a sharded checkpoint (`index`'s weight_map), or nullopt
// when the map does not name it.
absl::StatusOr<std::optional<Located>> FindSharded(const LmHeadOpener& open, const std::string& index,
                                                   const nlohmann::json& weight_map, const std::string& name,
                                                   uint64_t max_header_bytes) {
  auto it = weight_map.find(name);
  if (it == weight_map.end()) return std::optional<Located>();
  if (!it->is_string())
    return absl::InvalidArgumentError(absl::StrCat(index, ": weight_map[\"", name, "\"] is not a file name"));
  // The shard is opened (confined, for a client's index) before any byte
  // of it is read, and read only through that descriptor.
  const std::string shard = Join(fs::path(index).parent_path().string(), it->get<std::string>());
  absl::StatusOr<OpenedFile> opened = open(shard, /*dir_ok=*/false);
  if (!opened.ok())
    return absl::Status(opened.status().code(),
                        absl::StrCat(index, ": shard of \"", name, "\": ", opened.status().message()));
  absl::StatusOr<SafetensorsHeader> header =
      ReadSafetensorsHeader(opened->fd.get(), opened->size, shard, max_header_bytes);
  if (!header.ok())
    return absl::Status(header.status().code(),
                        absl::StrCat(index, ": shard of \"", name, "\": ", header.status().message()));
  const SafetensorsEntry* e = header->Find(name);
  if (e == nullptr)
    return absl::NotFoundError(
        absl::StrCat(index, " puts tensor \"", name, "\" in ", shard, ", which has no such tensor"));
  SafetensorsEntry entry = *e;
  return std::optional<Located>(
      Located{shard, *std::move(header), std::move(entry), std::make_shared<UniqueFd>(std::move(opened->fd))});
}

// The bias of weight tensor `weight`: "X.bias" for "X.weight", and
// lm_head.bias for the tied embedding (or any other name).
std::string BiasName(const std::string& weight) {
  constexpr std::string_view kSuffix = ".weight";
  if (weight != kTiedEmbeddingTensor && weight.size() > kSuffix.size() &&
      weight.compare(weight.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0)
    return weight.substr(0, weight.size() - kSuffix.size()) + ".bias";
  return "lm_head.bias";
}

// Positioned reads of [offset, offset + size) of `file` into `out`; `what`
// names the range in errors.
absl::Status ReadRange(int fd, const std::string& file, uint64_t offset, uint64_t size, void* out,
                       const std::string& what) {
  if (size == 0) return absl::OkStatus();
  absl::Status status;
  for (uint64_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, static_cast<char*>(out) + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      status = absl::DataLossError(
          absl::StrCat(file, ": ", n == 0 ? std::string("file ends") : std::generic_category().message(errno),
                       " at byte ", offset + done, " but ", what, " end at byte ", offset + size));
      break;
    }
    done += static_cast<uint64_t>(n);
  }
  return status;
}

}  // namespace

absl::StatusOr<LmHeadSource> ResolveLmHead(const std::string& arg, const LmHeadScalarFlags& flags) {
  std::string path = arg, tensor;
  if (const size_t colon = arg.rfind(':'); !Exists(arg) && colon != std::string::npos) {
    path = arg.substr(0, colon);
    tensor = arg.substr(colon + 1);
    if (tensor.empty()) return absl::InvalidArgumentError(absl::StrCat("lm_head: empty tensor name in \"", arg, "\""));
  }
  LOGPROB_ASSIGN_OR_RETURN(OpenedLmHead opened, ResolveLmHeadWith(OpenTrusted, path, tensor, flags));
  return std::move(opened.source);
}

absl::StatusOr<OpenedLmHead> ResolveLmHeadWith(const LmHeadOpener& open, const std::string& path,
                                               const std::string& tensor, const LmHeadScalarFlags& flags,
                                               uint64_t max_metadata_bytes) {
  bool is_dir = false;
  std::string file;
  LOGPROB_ASSIGN_OR_RETURN(OpenedFile top, CheckpointFile(open, path, &is_dir, &file));
  std::shared_ptr<UniqueFd> weight_fd;
  const std::vector<std::string> names =
      tensor.empty() ? std::vector<std::string>{kLmHeadTensor, kTiedEmbeddingTensor} : std::vector<std::string>{tensor};

  LmHeadSource source;
  bool found = false;
  std::optional<nlohmann::json> weight_map;     // of a sharded checkpoint
  std::optional<SafetensorsHeader> single;      // of a single file
  if (fs::path(file).extension() == ".json") {  // sharded: find the shard, then the tensor in it
    LOGPROB_ASSIGN_OR_RETURN(weight_map, ReadWeightMap(top.fd.get(), file, max_metadata_bytes));
    for (const std::string& name : names) {
      absl::StatusOr<std::optional<Located>> located = FindSharded(open, file, *weight_map, name, max_metadata_bytes);
      if (!located.ok()) return located.status();
      if (!located->has_value()) continue;
      LOGPROB_ASSIGN_OR_RETURN(source, FromEntry((*located)->file, (*located)->header, (*located)->entry));
      weight_fd = (*located)->fd;
      found = true;
      break;
    }
  } else {
    LOGPROB_ASSIGN_OR_RETURN(single, ReadSafetensorsHeader(top.fd.get(), top.size, file, max_metadata_bytes));
    const SafetensorsHeader& header = *single;
    weight_fd = std::make_shared<UniqueFd>(std::move(top.fd));
    for (const std::string& name : names)
      if (const SafetensorsEntry* e = header.Find(name)) {
        LOGPROB_ASSIGN_OR_RETURN(source, FromEntry(file, header, *e));
        found = true;
        break;
      }
  }
  if (!found)
    return absl::NotFoundError(absl::StrCat("lm_head: no tensor \"", absl::StrJoin(names, "\" or \""), "\" in ", file));

  // The bias, beside the weight.
  const std::string bias_name = BiasName(source.tensor);
  std::optional<Located> bias;
  if (weight_map.has_value()) {
    LOGPROB_ASSIGN_OR_RETURN(bias, FindSharded(open, file, *weight_map, bias_name, max_metadata_bytes));
  } else if (const SafetensorsEntry* e = single->Find(bias_name)) {
    bias = Located{source.file, *single, *e, weight_fd};
  }
  if (bias.has_value()) {
    const SafetensorsEntry& e = bias->entry;
    if (e.shape.size() != 1 || e.shape[0] != source.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(bias->file, ": tensor \"", e.name, "\" has shape [",
                                                     absl::StrJoin(e.shape, ", "), "], not [", source.vocab_size,
                                                     "] (the bias of ", source.tensor, ")"));
    if (!IsFloatDType(e.dtype))
      return absl::InvalidArgumentError(
          absl::StrCat(bias->file, ": tensor \"", e.name, "\" is ", DTypeName(e.dtype), ", not F32, BF16 or F16"));
    source.bias.file = bias->file;
    source.bias.tensor = e.name;
    source.bias.dtype = e.dtype;
    source.bias.data_offset = bias->header.data_start + e.begin;
    source.transform.has_bias = true;
  }

  // The scalars: config.json of a checkpoint directory, else the flags.
  const fs::path config = Join(path, kModelConfigFile);
  absl::StatusOr<OpenedFile> config_file =
      is_dir ? open(config.string(), /*dir_ok=*/false) : absl::NotFoundError("not a directory");
  if (!config_file.ok() && config_file.status().code() != absl::StatusCode::kNotFound) return config_file.status();
  if (config_file.ok()) {
    LOGPROB_ASSIGN_OR_RETURN(const std::string text, ReadWholeFile(config_file->fd.get(), config.string(),
                                                                   std::min(max_metadata_bytes, kMaxJsonBytes)));
    LOGPROB_ASSIGN_OR_RETURN(const LmHeadScalars scalars, LmHeadScalarsFromConfig(text, config.string()));
    if (scalars.bias_required && !source.transform.has_bias)
      return absl::InvalidArgumentError(
          absl::StrCat(config.string(), " says lm_head_bias: true but ", file, " holds no tensor \"", bias_name, "\""));
    auto said = [&](const std::string& from, double v) {
      return from.empty() ? std::string("nothing (") + (v == 1.0 ? "1" : "none") + ")"
                          : absl::StrCat(from, " (", v, ")");
    };
    if (flags.logit_scale.has_value() && *flags.logit_scale != scalars.logit_scale)
      return absl::InvalidArgumentError(absl::StrCat("--lm-head-logit-scale ", *flags.logit_scale, " contradicts ",
                                                     config.string(), ", which gives the logit multiplier ",
                                                     said(scalars.logit_scale_from, scalars.logit_scale)));
    if (flags.softcap.has_value() && *flags.softcap != scalars.softcap)
      return absl::InvalidArgumentError(absl::StrCat("--lm-head-softcap ", *flags.softcap, " contradicts ",
                                                     config.string(), ", which gives the final-logit softcap ",
                                                     said(scalars.softcap_from, scalars.softcap)));
    source.transform.logit_scale = scalars.logit_scale;
    source.transform.softcap = scalars.softcap;
    source.config_file = config.string();
  } else {
    if (flags.logit_scale.has_value()) source.transform.logit_scale = *flags.logit_scale;
    if (flags.softcap.has_value()) source.transform.softcap = *flags.softcap;
  }
  if (!(source.transform.logit_scale > 0) || !std::isfinite(source.transform.logit_scale))
    return absl::InvalidArgumentError(
        absl::StrCat("--lm-head-logit-scale ", source.transform.logit_scale, ": a finite number > 0 is needed"));
  if (!(source.transform.softcap >= 0) || !std::isfinite(source.transform.softcap))
    return absl::InvalidArgumentError(
        absl::StrCat("--lm-head-softcap ", source.transform.softcap, ": a finite number >= 0 is needed (0: none)"));
  return OpenedLmHead{std::move(source), std::move(weight_fd)};
}

absl::Status ReadLmHeadRows(const LmHeadSource& source, int64_t row_begin, int64_t row_end, void* out) {
  if (row_begin < 0 || row_begin > row_end || row_end > source.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("lm_head rows [", row_begin, ", ", row_end, ") are outside [0, ",
                                                   source.vocab_size, ") of ", source.file));
  LOGPROB_ASSIGN_OR_RETURN(const OpenedFile f, OpenTrusted(source.file));
  return ReadLmHeadRows(f.fd.get(), source, row_begin, row_end, out);
}

absl::Status ForEachLmHeadRowPiece(const LmHeadSource& source, int64_t row_begin, int64_t row_end, int64_t piece_bytes,
                                   std::string* piece, const std::function<absl::Status(int64_t first_row)>& emit) {
  if (row_begin < 0 || row_begin > row_end || row_end > source.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("lm_head rows [", row_begin, ", ", row_end, ") are outside [0, ",
                                                   source.vocab_size, ") of ", source.file));
  if (row_begin == row_end) return absl::OkStatus();
  LOGPROB_ASSIGN_OR_RETURN(const OpenedFile f, OpenTrusted(source.file));
  const int64_t row_bytes = source.hidden_size * static_cast<int64_t>(DTypeSize(source.dtype));
  const int64_t rows_per_piece = std::max<int64_t>(1, piece_bytes / row_bytes);
  for (int64_t r = row_begin; r < row_end; r += rows_per_piece) {
    const int64_t e = std::min(row_end, r + rows_per_piece);
    piece->resize(static_cast<size_t>((e - r) * row_bytes));
    LOGPROB_RETURN_IF_ERROR(ReadLmHeadRows(f.fd.get(), source, r, e, piece->data()));
    LOGPROB_RETURN_IF_ERROR(emit(r));
  }
  return absl::OkStatus();
}

absl::Status ReadLmHeadRows(int fd, const LmHeadSource& source, int64_t row_begin, int64_t row_end, void* out) {
  if (row_begin < 0 || row_begin > row_end || row_end > source.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("lm_head rows [", row_begin, ", ", row_end, ") are outside [0, ",
                                                   source.vocab_size, ") of ", source.file));
  const uint64_t row_bytes = static_cast<uint64_t>(source.hidden_size) * DTypeSize(source.dtype);
  return ReadRange(fd, source.file, source.data_offset + static_cast<uint64_t>(row_begin) * row_bytes,
                   static_cast<uint64_t>(row_end - row_begin) * row_bytes, out,
                   absl::StrCat("lm_head rows [", row_begin, ", ", row_end, ")"));
}

absl::Status ReadLmHeadBias(const LmHeadSource& source, int64_t row_begin, int64_t row_end, float* out) {
  if (source.bias.file.empty())
    return absl::FailedPreconditionError(absl::StrCat("lm_head ", source.tensor, " of ", source.file, " has no bias"));
  if (row_begin < 0 || row_begin > row_end || row_end > source.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat("lm_head bias elements [", row_begin, ", ", row_end,
                                                   ") are outside [0, ", source.vocab_size, ") of ", source.bias.file));
  const size_t n = static_cast<size_t>(row_end - row_begin), elem = DTypeSize(source.bias.dtype);
  std::vector<char> raw(n * elem);
  LOGPROB_ASSIGN_OR_RETURN(const OpenedFile f, OpenTrusted(source.bias.file));
  LOGPROB_RETURN_IF_ERROR(ReadRange(
      f.fd.get(), source.bias.file, source.bias.data_offset + static_cast<uint64_t>(row_begin) * elem, raw.size(),
      raw.data(), absl::StrCat(source.bias.tensor, " elements [", row_begin, ", ", row_end, ")")));
  ToFloat(source.bias.dtype, raw.data(), n, out);
  return absl::OkStatus();
}

}  // namespace logprob
