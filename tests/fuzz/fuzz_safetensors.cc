// libFuzzer target: safetensors parsing (common/safetensors.h).
//
// bytes -> ParseSafetensors; on success every tensor must be consistent
// (non-negative dims, data size = numel * dtype size without overflow), and
// SerializeSafetensors -> ParseSafetensors must give back the same names,
// dtypes, shapes, data and metadata. The bytes are also written to a file
// and ReadSafetensorsHeader must agree with ParseSafetensors (success or
// failure, entries, data ranges). Each input is also decoded by
// StructuredFile() into a well-formed-looking file (names, dtypes, dims
// around the overflow edges, mostly consistent data_offsets) and checked
// the same way, so the checks after the JSON parse are reached often.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"

namespace {

std::string g_path;  // this process's scratch file

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_safetensors: invariant violated: %s\n", what);
    __builtin_trap();
  }
}

// numel * DTypeSize(dtype), or -1 when a dim is negative or it overflows.
__int128 ByteSize(logprob::DType dtype, const std::vector<int64_t>& shape) {
  __int128 n = static_cast<__int128>(logprob::DTypeSize(dtype));
  for (int64_t d : shape) {
    if (d < 0) return -1;
    n *= d;
    if (n > (static_cast<__int128>(1) << 64)) n = static_cast<__int128>(1) << 64;  // saturate
  }
  return n;
}

void CheckTensor(const logprob::v1::Tensor& t) {
  Check(logprob::DTypeSize(t.dtype()) != 0, "tensor dtype is supported");
  const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  const __int128 bytes = ByteSize(t.dtype(), shape);
  Check(bytes >= 0, "tensor dims are non-negative");
  Check(bytes == static_cast<__int128>(t.data().size()), "tensor data size == numel * dtype size");
}

using TensorMap = std::map<std::string, const logprob::v1::Tensor*>;

TensorMap ByName(const logprob::SafetensorsFile& f) {
  TensorMap m;
  for (const auto& t : f.tensors) {
    const bool fresh = m.emplace(t.name(), &t).second;
    Check(fresh, "tensor names are unique");
  }
  return m;
}

bool SameTensor(const logprob::v1::Tensor& a, const logprob::v1::Tensor& b) {
  return a.name() == b.name() && a.dtype() == b.dtype() &&
         std::vector<int64_t>(a.shape().begin(), a.shape().end()) ==
             std::vector<int64_t>(b.shape().begin(), b.shape().end()) &&
         a.data() == b.data();
}

bool WriteScratch(const uint8_t* data, size_t size) {
  FILE* f = std::fopen(g_path.c_str(), "wb");
  if (!f) return false;
  const bool ok = size == 0 || std::fwrite(data, 1, size, f) == size;
  return std::fclose(f) == 0 && ok;
}

// A safetensors file built from choices: header JSON with 0..4 tensors and
// maybe __metadata__, then the data section.
std::string StructuredFile(FuzzedDataProvider& p) {
  static const char* const kNames[] = {"a", "b", "lm_head.weight", "model.embed_tokens.weight", "", "__metadata__"};
  static const char* const kDTypes[] = {"F32", "BF16", "F16", "I32", "I64", "F64", "U8", "f32", ""};
  static const uint64_t kDims[] = {0,
                                   1,
                                   2,
                                   3,
                                   uint64_t{1} << 31,
                                   uint64_t{1} << 32,
                                   uint64_t{1} << 61,
                                   uint64_t{1} << 62,
                                   uint64_t{1} << 63,
                                   ~uint64_t{0},
                                   (~uint64_t{0}) / 3};
  nlohmann::json h = nlohmann::json::object();
  uint64_t off = 0;
  const int tensors = p.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < tensors; ++i) {
    const uint8_t n = p.ConsumeIntegral<uint8_t>();
    std::string name = n < 240 ? kNames[n % 6] : std::string(1, static_cast<char>('c' + n % 16));
    const int dt = p.ConsumeIntegralInRange<int>(0, 8);
    const size_t es = dt < 5 ? logprob::DTypeSize(static_cast<logprob::DType>(dt + 1)) : 1;
    nlohmann::json shape = nlohmann::json::array();
    uint64_t bytes = es;  // wrapping on purpose: what a careless parser computes
    const int rank = p.ConsumeIntegralInRange<int>(0, 4);
    for (int d = 0; d < rank; ++d) {
      const uint8_t s = p.ConsumeIntegral<uint8_t>();
      uint64_t dim = s < 160 ? s % 5 : s < 250 ? kDims[s % 11] : p.ConsumeIntegral<uint64_t>();
      if (s == 255) shape.push_back(-1);
      else if (s == 254) shape.push_back(1.5);
      else shape.push_back(dim);
      bytes *= dim;
    }
    const uint8_t o = p.ConsumeIntegral<uint8_t>();
    uint64_t begin = off, end = off + bytes;
    if (o >= 240) end += p.ConsumeIntegralInRange<int>(-2, 2);
    if (o >= 250) begin = p.ConsumeIntegral<uint64_t>();
    h[name] = {{"dtype", kDTypes[dt]}, {"shape", shape}, {"data_offsets", {begin, end}}};
    if (o == 1) h[name].erase("shape");
    if (end >= off && end - off < (1u << 16)) off = end;
  }
  if (p.ConsumeBool()) {
    const uint8_t m = p.ConsumeIntegral<uint8_t>();
    if (m < 200) h["__metadata__"] = {{"format", "pt"}, {"k", std::string(m % 4, 'v')}};
    else if (m < 230) h["__metadata__"] = {{"k", m}};
    else h["__metadata__"] = "pt";
  }
  std::string json = h.dump();
  json.append(p.ConsumeIntegralInRange<size_t>(0, 7), ' ');
  uint64_t n = json.size();
  if (p.ConsumeIntegral<uint8_t>() >= 252) n = p.ConsumeIntegral<uint64_t>();
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += json;
  std::string data = p.ConsumeBytesAsString(off);
  data.resize(off < (1u << 16) ? off : 0, '\0');
  return out + data;
}

void Exercise(const uint8_t* data, size_t size);

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/fuzz_safetensors.XXXXXX";
  const int fd = mkstemp(templ.data());
  if (fd < 0) {
    std::perror("fuzz_safetensors: mkstemp");
    std::abort();
  }
  close(fd);
  g_path = templ;
  std::atexit([] { unlink(g_path.c_str()); });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Exercise(data, size);
  FuzzedDataProvider p(data, size);
  const std::string file = StructuredFile(p);
  Exercise(reinterpret_cast<const uint8_t*>(file.data()), file.size());
  return 0;
}

namespace {

void Exercise(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<logprob::SafetensorsFile> parsed = logprob::ParseSafetensors(bytes);

  // The header-only reader must agree with the whole-file parser.
  if (!WriteScratch(data, size)) {
    std::perror("fuzz_safetensors: writing the scratch file");
    std::abort();
  }
  const absl::StatusOr<logprob::SafetensorsHeader> header = logprob::ReadSafetensorsHeader(g_path);
  Check(parsed.ok() == header.ok(), "ReadSafetensorsHeader and ParseSafetensors agree on success");
  if (!parsed.ok()) {
    Check(parsed.status().code() == absl::StatusCode::kInvalidArgument, "parse errors are INVALID_ARGUMENT");
    Check(header.status().code() == absl::StatusCode::kInvalidArgument, "header errors are INVALID_ARGUMENT");
    return;
  }

  const logprob::SafetensorsFile& file = *parsed;
  Check(header->entries.size() == file.tensors.size(), "header and file have as many tensors");
  Check(header->metadata == file.metadata, "header and file metadata agree");
  Check(header->data_start >= 8 && header->data_start <= size, "data section starts inside the file");
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const logprob::v1::Tensor& t = file.tensors[i];
    const logprob::SafetensorsEntry& e = header->entries[i];
    CheckTensor(t);
    Check(e.name == t.name() && e.dtype == t.dtype(), "entry name and dtype match the tensor");
    Check(e.shape == std::vector<int64_t>(t.shape().begin(), t.shape().end()), "entry shape matches the tensor");
    Check(e.begin <= e.end && e.end - e.begin == t.data().size(), "entry range matches the data size");
    Check(e.end <= size - header->data_start, "entry range is inside the data section");
    Check(std::string(bytes, header->data_start + e.begin, e.end - e.begin) == t.data(), "entry range holds the data");
    Check(file.Find(t.name()) != nullptr && header->Find(e.name) != nullptr, "Find finds each tensor");
    if (i > 0) Check(header->entries[i - 1].begin <= e.begin, "entries are in data order");
  }

  // Round trip. Tensors are compared by name: zero-size tensors sharing a
  // data offset have no defined relative order.
  const std::string again = logprob::SerializeSafetensors(file.tensors, file.metadata);
  Check(again.size() >= 8, "serialised file has a header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(again[i]);
  Check((8 + n) % 8 == 0, "serialised data section is 8-byte aligned");
  const absl::StatusOr<logprob::SafetensorsFile> reparsed = logprob::ParseSafetensors(again);
  if (!reparsed.ok()) {
    std::fprintf(stderr, "fuzz_safetensors: re-parse failed: %s\n", reparsed.status().ToString().c_str());
    __builtin_trap();
  }
  Check(reparsed->metadata == file.metadata, "round trip keeps the metadata");
  const TensorMap a = ByName(file), b = ByName(*reparsed);
  Check(a.size() == b.size(), "round trip keeps the tensor count");
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    Check(it != b.end(), "round trip keeps every tensor name");
    Check(SameTensor(*t, *it->second), "round trip keeps dtype, shape and data");
  }
}

}  // namespace
