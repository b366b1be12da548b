// Writes the seed inputs of the fuzzers: OUT/score_request/* (serialized
// valid ScoreRequests of each shape and option family) and
// OUT/safetensors/* (small files of every dtype, scalars, empty tensors,
// metadata), OUT/chunked/* (those requests, and responses of the same
// tensors, as ScoreChunked part streams for fuzz_chunked). Usage:
// gen_fuzz_seeds OUT
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/chunk_codec.h"
#include "common/dtype.h"
#include "common/safetensors.h"
#include "logprob/v1/logprob.pb.h"

namespace {

using logprob::v1::DType;
using logprob::v1::ScoreRequest;
using logprob::v1::Tensor;

Tensor Make(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<int64_t>& values = {}) {
  Tensor t;
  t.set_name(name);
  t.set_dtype(dtype);
  size_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= static_cast<size_t>(d);
  }
  const size_t es = logprob::DTypeSize(dtype);
  std::string data(n * es, '\0');
  for (size_t i = 0; i < n; ++i) {
    if (dtype == logprob::v1::I32) {
      const int32_t v = static_cast<int32_t>(i < values.size() ? values[i] : 0);
      std::memcpy(&data[i * 4], &v, 4);
    } else if (dtype == logprob::v1::I64) {
      const int64_t v = i < values.size() ? values[i] : 0;
      std::memcpy(&data[i * 8], &v, 8);
    } else {  // float rows: small distinct values
      const float f = 0.25f * static_cast<float>(i % 7) - 0.5f;
      if (dtype == logprob::v1::F32) std::memcpy(&data[i * 4], &f, 4);
      const uint16_t h = dtype == logprob::v1::BF16 ? logprob::FloatToBf16(f) : logprob::FloatToF16(f);
      if (es == 2) std::memcpy(&data[i * 2], &h, 2);
    }
  }
  t.set_data(data);
  return t;
}

/// Protobuf's base-128 varint of `n`.
std::string Varint(uint64_t n) {
  std::string out;
  do {
    out.push_back(static_cast<char>((n & 0x7f) | (n > 0x7f ? 0x80 : 0)));
    n >>= 7;
  } while (n);
  return out;
}

/// `part` framed for fuzz_chunked: [u32 little-endian length][part].
std::string Frame(const std::string& part) {
  const uint32_t n = static_cast<uint32_t>(part.size());
  return std::string{static_cast<char>(n & 0xff), static_cast<char>((n >> 8) & 0xff),
                     static_cast<char>((n >> 16) & 0xff), static_cast<char>(n >> 24)} +
         part;
}

bool WriteFile(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT\n", argv[0]);
    return 2;
  }
  const std::string out = argv[1];
  for (const std::string& d : {out, out + "/score_request", out + "/safetensors", out + "/chunked"})
    mkdir(d.c_str(), 0755);
  using namespace logprob::v1;
  std::vector<ScoreRequest> reqs;
  {  // padded f32 [2, 3, 5], next_token
    ScoreRequest r;
    r.set_id("padded");
    *r.add_inputs() = Make("logits", F32, {2, 3, 5});
    *r.add_inputs() = Make("input_ids", I64, {2, 3}, {0, 1, 4, 2, 3, -100});
    reqs.push_back(r);
  }
  {  // padded bf16 with seq_lens, entropy, topk, temperature, sampling filters
    ScoreRequest r;
    r.set_id("seq_lens");
    *r.add_inputs() = Make("logits", BF16, {3, 4, 6});
    *r.add_inputs() = Make("input_ids", I32, {3, 4}, {1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0});
    *r.add_inputs() = Make("seq_lens", I64, {3}, {4, 2, 0});
    r.mutable_options()->set_entropy(true);
    r.mutable_options()->set_topk(3);
    r.mutable_options()->set_temperature(0.7f);
    r.mutable_options()->set_sampling_top_k(2);
    r.mutable_options()->set_sampling_top_p(0.9f);
    reqs.push_back(r);
  }
  {  // packed f16 with cu_seqlens and gather_indices [T - B, K]
    ScoreRequest r;
    r.set_id("packed");
    *r.add_inputs() = Make("logits", F16, {6, 4});
    *r.add_inputs() = Make("input_ids", I64, {6}, {0, 1, 2, 3, 2, 1});
    *r.add_inputs() = Make("cu_seqlens", I32, {3}, {0, 2, 6});
    *r.add_inputs() = Make("gather_indices", I64, {4, 2}, {0, 3, 1, 2, 2, 1, 3, 0});
    reqs.push_back(r);
  }
  {  // same_position, ignore_index set, gather on a padded batch
    ScoreRequest r;
    r.set_id("same_position");
    *r.add_inputs() = Make("logits", F32, {1, 3, 4});
    *r.add_inputs() = Make("input_ids", I64, {1, 3}, {7, 0, 3});
    *r.add_inputs() = Make("gather_indices", I32, {1, 3, 1}, {1, 2, 3});
    r.mutable_options()->set_alignment(SAME_POSITION);
    r.mutable_options()->set_ignore_index(7);
    reqs.push_back(r);
  }
  {  // hidden states [1, 4, 16] for an lm_head of V = 64, H = 16
    ScoreRequest r;
    r.set_id("hidden");
    *r.add_inputs() = Make("hidden_states", BF16, {1, 4, 16});
    *r.add_inputs() = Make("input_ids", I64, {1, 4}, {5, 63, 0, 17});
    r.mutable_options()->set_topk(4);
    reqs.push_back(r);
  }
  {  // packed hidden states
    ScoreRequest r;
    r.set_id("hidden_packed");
    *r.add_inputs() = Make("hidden_states", F32, {5, 16});
    *r.add_inputs() = Make("input_ids", I32, {5}, {1, 2, 3, 4, 5});
    *r.add_inputs() = Make("cu_seqlens", I64, {3}, {0, 3, 5});
    reqs.push_back(r);
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::string bytes;
    if (!reqs[i].SerializeToString(&bytes) || !WriteFile(out + "/score_request/" + reqs[i].id() + ".pb", bytes)) {
      std::fprintf(stderr, "cannot write seed %s\n", reqs[i].id().c_str());
      return 1;
    }
  }
  // fuzz_chunked: each request, and a response of the same tensors as
  // outputs, as the parts of a ScoreChunked stream (every tensor in pieces
  // of 7 and of 64 bytes), framed [u32 length][part].
  for (const ScoreRequest& r : reqs) {
    for (int response = 0; response < 2; ++response) {
      for (size_t piece : {size_t{7}, size_t{64}}) {
        logprob::v1::ScoreResponse resp;
        ScoreRequest header = r;
        auto* tensors = response ? resp.mutable_outputs() : header.mutable_inputs();
        if (response) *tensors = r.inputs();
        std::vector<std::string> parts(1);
        std::vector<std::pair<int, std::string>> pieced;
        for (int i = 0; i < tensors->size(); ++i)
          if (!tensors->Get(i).data().empty()) pieced.push_back({i, std::move(*tensors->Mutable(i)->mutable_data())});
        const std::string message = response ? resp.SerializeAsString() : header.SerializeAsString();
        parts[0] = Frame(std::string(1, '\x0a') + Varint(message.size()) + message);
        for (const auto& [i, bytes] : pieced)
          for (size_t off = 0; off < bytes.size(); off += piece) {
            const std::string data = bytes.substr(off, piece);
            parts.push_back(Frame(logprob::chunked::PieceHeader(i, static_cast<int64_t>(off), data.size()) + data));
          }
        std::string stream(1, static_cast<char>(2 | response));
        for (const std::string& p : parts) stream += p;
        const std::string name =
            out + "/chunked/" + r.id() + (response ? ".response." : ".request.") + std::to_string(piece);
        if (!WriteFile(name, stream)) {
          std::fprintf(stderr, "cannot write seed %s\n", name.c_str());
          return 1;
        }
      }
    }
  }

  struct StFile {
    const char* name;
    std::vector<Tensor> tensors;
    std::map<std::string, std::string> meta;
  };
  const std::vector<StFile> files = {
      {"all_dtypes",
       {Make("a", F32, {2, 3}), Make("b", BF16, {4}), Make("c", F16, {1, 1, 2}), Make("d", I32, {3}, {1, -2, 3}),
        Make("e", I64, {2}, {-100, 5})},
       {{"alignment", "next_token"}, {"topk", "2"}}},
      {"scalar_and_empty", {Make("s", F32, {}), Make("z", I64, {0, 4}), Make("y", BF16, {3, 0})}, {}},
      {"empty", {}, {}},
      {"metadata_only", {}, {{"format", "pt"}}},
  };
  for (const StFile& f : files) {
    if (!WriteFile(out + "/safetensors/" + f.name + ".safetensors", logprob::SerializeSafetensors(f.tensors, f.meta))) {
      std::fprintf(stderr, "cannot write seed %s\n", f.name);
      return 1;
    }
  }
  return 0;
}
