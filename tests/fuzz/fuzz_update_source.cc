// libFuzzer target: lm_head update file sources (issue 32, findings 1-3):
// an update folder built from the input (shards with fuzzed safetensors
// headers and bytes, a model.safetensors.index.json whose weight_map names
// fuzzed paths among them: "..", absolute paths, a symlink to a folder
// outside, a FIFO, a directory, absent files; a config.json), then the
// resolution a PutLmHeadRows{file} makes: ResolveLmHeadWith over
// OpenBeneath(DIR) of a fuzzed path and tensor, and reads of its rows.
//
// Invariants: no crash, hang (a FIFO never blocks) or sanitizer report;
// every error has a documented code; no error message holds a byte of the
// secret file outside DIR, nor DIR's real path; a resolved head's weight is
// read only through the descriptor opened beneath DIR, and its rows read
// within the file or fail with DATA_LOSS. A violated invariant traps.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/confined_file.h"
#include "common/lm_head_source.h"
#include "google/protobuf/stubs/logging.h"

namespace {

#define CHECK(cond)                                                                                    \
  do {                                                                                                 \
    if (!(cond)) {                                                                                     \
      std::fprintf(stderr, "fuzz_update_source: invariant violated: %s (line %d)\n", #cond, __LINE__); \
      __builtin_trap();                                                                                \
    }                                                                                                  \
  } while (0)

// The outside file's bytes (64: a [1, 16] F32 head); no answer may hold its marker.
constexpr char kSecret[] = "SECRET-0123456789-outside-the-update-folder-padded-to-64-bytes!!";
constexpr char kMarker[] = "SECRET-0123456789";

std::string* base = nullptr;  // per process: BASE/{outside,updates}

/// Paths an index or a request may name: valid shards and every kind of
/// escape the update surface must refuse.
const std::vector<std::string>& Names() {
  static const std::vector<std::string> names = {"a.safetensors",
                                                 "b.safetensors",
                                                 "sub/c.safetensors",
                                                 "link/secret.safetensors",
                                                 "fifo",
                                                 "sub",
                                                 "absent.safetensors",
                                                 "../outside/secret.safetensors",
                                                 "sub/../a.safetensors",
                                                 "/etc/passwd",
                                                 "",
                                                 "model.safetensors.index.json",
                                                 "config.json",
                                                 "./a.safetensors",
                                                 "sub//c.safetensors",
                                                 "link",
                                                 "a.safetensors:lm_head.weight"};
  return names;
}

/// A safetensors file: an 8-byte length, a header of fuzzed JSON (often a
/// well-formed one), and fuzzed bytes.
std::string Safetensors(FuzzedDataProvider& in) {
  std::string header;
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      header = in.ConsumeRandomLengthString(256);
      break;
    default: {
      const int64_t v = in.ConsumeIntegralInRange<int64_t>(-1, 9), h = in.ConsumeIntegralInRange<int64_t>(0, 5);
      const char* dtype = in.PickValueInArray({"F32", "BF16", "F16", "I64", "F64", "X"});
      const int64_t begin = in.ConsumeIntegralInRange<int64_t>(-2, 8);
      const int64_t end = begin + in.ConsumeIntegralInRange<int64_t>(-4, 400);
      const char* name = in.PickValueInArray({"lm_head.weight", "model.embed_tokens.weight", "lm_head.bias", "w"});
      header = absl::StrCat("{\"", name, "\":{\"dtype\":\"", dtype, "\",\"shape\":[", v, ",", h, "],\"data_offsets\":[",
                            begin, ",", end, "]}}");
    }
  }
  uint64_t length = header.size();
  if (in.ConsumeBool()) length = in.ConsumeIntegral<uint64_t>();  // lies about its header
  std::string file(reinterpret_cast<const char*>(&length), 8);
  file += header;
  file += in.ConsumeRandomLengthString(512);
  return file;
}

/// One of Names(), chosen by the input.
const std::string& PickName(FuzzedDataProvider& in) {
  return Names()[in.ConsumeIntegralInRange<size_t>(0, Names().size() - 1)];
}

void Write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  char tmpl[] = "/tmp/fuzz_update_source.XXXXXX";
  CHECK(mkdtemp(tmpl) != nullptr);
  base = new std::string(tmpl);
  std::atexit([] { std::filesystem::remove_all(*base); });
  std::filesystem::create_directories(*base + "/outside");
  // The secret: a valid head outside the folder, and a file of plain bytes.
  {
    static_assert(sizeof kSecret - 1 == 64);
    std::string header = R"({"lm_head.weight":{"dtype":"F32","shape":[1,16],"data_offsets":[0,64]}})";
    uint64_t n = header.size();
    Write(*base + "/outside/secret.safetensors", std::string(reinterpret_cast<const char*>(&n), 8) + header + kSecret);
    Write(*base + "/outside/plain", kSecret);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string dir = *base + "/updates";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/sub");
  Write(dir + "/a.safetensors", Safetensors(in));
  Write(dir + "/b.safetensors", Safetensors(in));
  Write(dir + "/sub/c.safetensors", Safetensors(in));
  CHECK(symlink((*base + "/outside").c_str(), (dir + "/link").c_str()) == 0);
  CHECK(mkfifo((dir + "/fifo").c_str(), 0600) == 0);
  if (in.ConsumeBool()) {
    std::string index = "{\"weight_map\":{";
    const int entries = in.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < entries; ++i) {
      const char* tensor = in.PickValueInArray({"lm_head.weight", "model.embed_tokens.weight", "lm_head.bias"});
      absl::StrAppend(&index, i ? "," : "", "\"", tensor, "\":\"", PickName(in), "\"");
    }
    index += "}}";
    if (in.ConsumeBool()) index = in.ConsumeRandomLengthString(128);
    Write(dir + "/model.safetensors.index.json", index);
  }
  if (in.ConsumeBool()) Write(dir + "/config.json", in.ConsumeRandomLengthString(128));
  const std::string path = in.ConsumeBool() ? PickName(in) : in.ConsumeRandomLengthString(64);
  const std::string tensor = in.ConsumeBool() ? "" : in.PickValueInArray({"lm_head.weight", "w", "x.weight"});

  const int root = open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  CHECK(root >= 0);
  const bool walk = in.ConsumeBool();
  const logprob::LmHeadOpener beneath = [root, walk](const std::string& p, bool dir_ok) {
    return logprob::OpenBeneathWith(root, p, "file.path", dir_ok, walk);
  };
  const absl::StatusOr<logprob::OpenedLmHead> opened = logprob::ResolveLmHeadWith(beneath, path, tensor);
  if (!opened.ok()) {
    const absl::StatusCode code = opened.status().code();
    CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
          code == absl::StatusCode::kPermissionDenied || code == absl::StatusCode::kFailedPrecondition ||
          code == absl::StatusCode::kDataLoss);
    const std::string message(opened.status().message());
    // (The client's own path or tensor name is echoed: the marker may be in
    // it when the fuzzer wrote it there.)
    CHECK(message.find(kMarker) == std::string::npos || path.find(kMarker) != std::string::npos ||
          tensor.find(kMarker) != std::string::npos);
    // The folder's real path is never echoed (unless the client's own path
    // holds it: libFuzzer learns the compared string and writes it there).
    CHECK(message.find(*base) == std::string::npos || path.find(*base) != std::string::npos ||
          tensor.find(*base) != std::string::npos);
  } else {
    // The weight is read through the descriptor opened beneath the folder.
    const logprob::LmHeadSource& s = opened->source;
    CHECK(opened->weight && opened->weight->valid());
    CHECK(s.vocab_size > 0 && s.hidden_size > 0);
    const int64_t rows = std::min<int64_t>(s.vocab_size, 4);
    std::vector<char> buf(static_cast<size_t>(rows * s.hidden_size) * 4);
    const absl::Status read = logprob::ReadLmHeadRows(opened->weight->get(), s, 0, rows, buf.data());
    CHECK(read.ok() || read.code() == absl::StatusCode::kDataLoss || read.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(buf.begin(), buf.end()).find("SECRET-01") == std::string::npos);  // never the outside file
  }
  close(root);
  return 0;
}
