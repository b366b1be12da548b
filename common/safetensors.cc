#include "common/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "nlohmann/json.hpp"

namespace logprob {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // as the reference impl

absl::Status Bad(const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat("malformed safetensors: ", msg));
}

}  // namespace

const v1::Tensor* SafetensorsFile::Find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name() == name) return &t;
  return nullptr;
}

absl::StatusOr<SafetensorsFile> ParseSafetensors(const std::string& bytes) {
  if (bytes.size() < 8) return Bad(absl::StrCat("file is ", bytes.size(), " bytes, shorter than the 8-byte header length"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  if (n > kMaxHeaderBytes) return Bad(absl::StrCat("header length ", n, " exceeds ", kMaxHeaderBytes));
  if (8 + n > bytes.size()) return Bad(absl::StrCat("header length ", n, " runs past the end of the file (", bytes.size(), " bytes)"));
  nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + n, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return Bad("header is not a JSON object");
  const uint64_t data_len = bytes.size() - 8 - n;
  const char* data = bytes.data() + 8 + n;

  SafetensorsFile file;
  struct Entry { uint64_t begin; v1::Tensor t; };
  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return Bad(absl::StrCat("__metadata__[\"", m.key(), "\"] is not a string"));
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      return Bad(absl::StrCat("tensor \"", name, "\" lacks dtype, shape or data_offsets"));
    if (!v["dtype"].is_string()) return Bad(absl::StrCat("tensor \"", name, "\": dtype is not a string"));
    DType dtype;
    const std::string dname = v["dtype"].get<std::string>();
    if (!ParseDTypeName(dname, &dtype))
      return Bad(absl::StrCat("tensor \"", name, "\": unsupported dtype ", dname, " (F32, BF16, F16, I32, I64 are)"));
    v1::Tensor t;
    t.set_name(name);
    t.set_dtype(dtype);
    uint64_t numel = 1;
    if (!v["shape"].is_array()) return Bad(absl::StrCat("tensor \"", name, "\": shape is not a list"));
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) return Bad(absl::StrCat("tensor \"", name, "\": shape entry is not a non-negative integer"));
      uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > (uint64_t{1} << 62) / dim) return Bad(absl::StrCat("tensor \"", name, "\": shape overflows"));
      numel *= dim;
      t.add_shape(static_cast<int64_t>(dim));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return Bad(absl::StrCat("tensor \"", name, "\": data_offsets is not [begin, end]"));
    uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_len)
      return Bad(absl::StrCat("tensor \"", name, "\": data_offsets [", b, ", ", e, "] outside the ", data_len, " data bytes"));
    if (e - b != numel * DTypeSize(dtype))
      return Bad(absl::StrCat("tensor \"", name, "\": ", e - b, " data bytes but shape and dtype need ", numel * DTypeSize(dtype)));
    t.set_data(data + b, e - b);
    entries.push_back({b, std::move(t)});
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (auto& e : entries) file.tensors.push_back(std::move(e.t));
  return file;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  auto parsed = ParseSafetensors(ss.str());
  if (!parsed.ok()) return absl::Status(parsed.status().code(), absl::StrCat(path, ": ", parsed.status().message()));
  return parsed;
}

std::string SerializeSafetensors(const std::vector<v1::Tensor>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    header[t.name()] = {{"dtype", std::string(DTypeName(t.dtype()))},
                        {"shape", shape},
                        {"data_offsets", {offset, offset + t.data().size()}}};
    offset += t.data().size();
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');  // align data to 8 bytes
  std::string out;
  out.reserve(8 + h.size() + offset);
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += h;
  for (const auto& t : tensors) out += t.data();
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<v1::Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp));
    const std::string bytes = SerializeSafetensors(tensors, metadata);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) return absl::DataLossError(absl::StrCat("short write to ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  return absl::OkStatus();
}

}  // namespace logprob
