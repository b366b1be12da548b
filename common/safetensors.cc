#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/confined_file.h"
#include "common/dtype.h"
#include "common/positioned_io.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace logprob {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // as the reference impl

absl::Status Bad(const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat("malformed safetensors: ", msg));
}

// Header length N from the first min(8, file_size) bytes of a file,
// checked against the limit and the file size.
absl::StatusOr<uint64_t> HeaderLength(const char* prefix, uint64_t file_size, uint64_t limit = kMaxHeaderBytes) {
  if (file_size < 8) return Bad(absl::StrCat("file is ", file_size, " bytes, shorter than the 8-byte header length"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(prefix[i]);
  // The length read is not printed: the file may be anything (its bytes
  // are not the caller's to see).
  if (n > std::min(limit, kMaxHeaderBytes))
    return Bad(
        absl::StrCat("not a safetensors file (its header length exceeds ", std::min(limit, kMaxHeaderBytes), ")"));
  if (8 + n > file_size)
    return Bad(
        absl::StrCat("not a safetensors file (its header runs past the end of the file, ", file_size, " bytes)"));
  return n;
}

// Parses and validates the n-byte JSON header of a file whose data section
// (after it) is data_len bytes.
absl::StatusOr<SafetensorsHeader> ParseHeader(const char* json, uint64_t n, uint64_t data_len) {
  nlohmann::json header = nlohmann::json::parse(json, json + n, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return Bad("header is not a JSON object");
  SafetensorsHeader out;
  out.data_start = 8 + n;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return Bad(absl::StrCat("__metadata__[\"", m.key(), "\"] is not a string"));
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      return Bad(absl::StrCat("tensor \"", name, "\" lacks dtype, shape or data_offsets"));
    if (!v["dtype"].is_string()) return Bad(absl::StrCat("tensor \"", name, "\": dtype is not a string"));
    SafetensorsEntry e;
    e.name = name;
    const std::string dname = v["dtype"].get<std::string>();
    if (!ParseDTypeName(dname, &e.dtype))
      return Bad(absl::StrCat("tensor \"", name, "\": unsupported dtype ", dname, " (F32, BF16, F16, I32, I64 are)"));
    // numel * DTypeSize must not wrap, and the dims must fit int64, also in
    // an empty tensor: the product of the non-zero dims is bounded.
    const uint64_t max_numel = (uint64_t{1} << 62) / DTypeSize(e.dtype);
    uint64_t numel = 1, extent = 1;
    if (!v["shape"].is_array()) return Bad(absl::StrCat("tensor \"", name, "\": shape is not a list"));
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned())
        return Bad(absl::StrCat("tensor \"", name, "\": shape entry is not a non-negative integer"));
      const uint64_t dim = d.get<uint64_t>();
      if (dim == 0) {
        numel = 0;
      } else {
        if (extent > max_numel / dim) return Bad(absl::StrCat("tensor \"", name, "\": shape overflows"));
        extent *= dim;
      }
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    if (numel != 0) numel = extent;
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return Bad(absl::StrCat("tensor \"", name, "\": data_offsets is not [begin, end]"));
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_len)
      return Bad(absl::StrCat("tensor \"", name, "\": data_offsets [", e.begin, ", ", e.end, "] outside the ", data_len,
                              " data bytes"));
    if (e.end - e.begin != numel * DTypeSize(e.dtype))
      return Bad(absl::StrCat("tensor \"", name, "\": ", e.end - e.begin, " data bytes but shape and dtype need ",
                              numel * DTypeSize(e.dtype)));
    out.entries.push_back(std::move(e));
  }
  std::stable_sort(out.entries.begin(), out.entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.begin < b.begin; });
  return out;
}

// Prefixes an error with the file it came from.
template <typename T>
absl::StatusOr<T> InFile(const std::string& path, absl::StatusOr<T> r) {
  if (r.ok()) return r;
  return absl::Status(r.status().code(), absl::StrCat(path, ": ", r.status().message()));
}

}  // namespace

const v1::Tensor* SafetensorsFile::Find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name() == name) return &t;
  return nullptr;
}

const SafetensorsEntry* SafetensorsHeader::Find(const std::string& name) const {
  for (const auto& e : entries)
    if (e.name == name) return &e;
  return nullptr;
}

namespace {

/// Parses `bytes` into tensors without data, and each tensor's bytes.
absl::StatusOr<SafetensorsFile> ParseViews(std::string_view bytes, std::vector<std::string_view>* data) {
  LOGPROB_ASSIGN_OR_RETURN(const uint64_t n, HeaderLength(bytes.data(), bytes.size()));
  LOGPROB_ASSIGN_OR_RETURN(SafetensorsHeader header, ParseHeader(bytes.data() + 8, n, bytes.size() - 8 - n));
  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  for (const SafetensorsEntry& e : header.entries) {
    v1::Tensor& t = file.tensors.emplace_back();
    t.set_name(e.name);
    t.set_dtype(e.dtype);
    for (int64_t d : e.shape) t.add_shape(d);
    data->push_back(bytes.substr(header.data_start + e.begin, e.end - e.begin));
  }
  return file;
}

}  // namespace

absl::StatusOr<SafetensorsFile> ParseSafetensors(std::string_view bytes) {
  std::vector<std::string_view> data;
  absl::StatusOr<SafetensorsFile> file = ParseViews(bytes, &data);
  if (!file.ok()) return file;
  for (size_t i = 0; i < data.size(); ++i) file->tensors[i].set_data(data[i].data(), data[i].size());
  return file;
}

absl::StatusOr<MappedSafetensors> MappedSafetensors::Open(const std::string& path) {
  MappedSafetensors m;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  struct stat st;
  std::string_view bytes;
  if (fstat(fd, &st) == 0 && st.st_size > 0) {
    void* map = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    if (map != MAP_FAILED) {
      m.map_ = map;
      m.size_ = static_cast<size_t>(st.st_size);
      bytes = std::string_view(static_cast<const char*>(map), m.size_);
    }
  }
  close(fd);
  if (m.map_ == nullptr) {  // empty, or not mappable (e.g. a pipe): read it
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
    std::ostringstream ss;
    ss << in.rdbuf();
    m.copy_ = ss.str();
    bytes = m.copy_;
  }
  std::vector<std::string_view> data;
  absl::StatusOr<SafetensorsFile> file = InFile(path, ParseViews(bytes, &data));
  if (!file.ok()) return file.status();
  m.file_ = *std::move(file);
  for (size_t i = 0; i < data.size(); ++i) m.data_[m.file_.tensors[i].name()] = data[i];
  return m;
}

MappedSafetensors::MappedSafetensors(MappedSafetensors&& o) noexcept
    : file_(std::move(o.file_)), data_(std::move(o.data_)), map_(o.map_), size_(o.size_) {
  o.map_ = nullptr;
  // Views into the copy follow its bytes (a short string's move copies them).
  const char* old = o.copy_.data();
  copy_ = std::move(o.copy_);
  if (map_ == nullptr)
    for (auto& [name, view] : data_) view = std::string_view(copy_.data() + (view.data() - old), view.size());
}

MappedSafetensors::~MappedSafetensors() {
  if (map_ != nullptr) munmap(map_, size_);
}

std::string_view MappedSafetensors::data(const std::string& name) const {
  auto it = data_.find(name);
  return it == data_.end() ? std::string_view() : it->second;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  absl::StatusOr<MappedSafetensors> mapped = MappedSafetensors::Open(path);
  if (!mapped.ok()) return mapped.status();
  SafetensorsFile file = std::move(mapped->file());
  for (v1::Tensor& t : file.tensors) {
    const std::string_view bytes = mapped->data(t.name());
    t.set_data(bytes.data(), bytes.size());
  }
  return file;
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path) {
  absl::StatusOr<OpenedFile> f = OpenTrusted(path);
  if (!f.ok()) return f.status();
  return ReadSafetensorsHeader(f->fd.get(), f->size, path);
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(int fd, uint64_t size, const std::string& name,
                                                        uint64_t max_header_bytes) {
  char prefix[8] = {};
  if (!PreadAll(fd, prefix, std::min<uint64_t>(8, size), 0))
    return absl::DataLossError(absl::StrCat("cannot read the header of ", name));
  absl::StatusOr<uint64_t> n = HeaderLength(prefix, size, max_header_bytes);
  if (!n.ok()) return InFile(name, absl::StatusOr<SafetensorsHeader>(n.status()));
  std::string json(*n, '\0');
  if (!PreadAll(fd, json.data(), *n, 8)) return absl::DataLossError(absl::StrCat("cannot read the header of ", name));
  return InFile(name, ParseHeader(json.data(), *n, size - 8 - *n));
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
