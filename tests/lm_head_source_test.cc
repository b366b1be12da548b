// ResolveLmHead / ReadLmHeadRows on small checkpoints written to a temp
// dir, and ReadSafetensorsHeader against ParseSafetensors.
#include "common/lm_head_source.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "common/safetensors.h"

namespace logprob {
namespace {

namespace fs = std::filesystem;

// A tensor whose bytes are a recognisable function of `seed` and position.
v1::Tensor MakeTensor(const std::string& name, DType dtype, std::vector<int64_t> shape, int seed) {
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(dtype);
  size_t n = DTypeSize(dtype);
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= static_cast<size_t>(d);
  }
  std::string data(n, '\0');
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>(i * 7 + seed * 31 + 1);
  t.set_data(data);
  return t;
}

// Bytes of rows [b, e) of a 2-D tensor.
std::string Rows(const v1::Tensor& t, int64_t b, int64_t e) {
  const size_t row = t.data().size() / static_cast<size_t>(t.shape(0));
  return t.data().substr(b * row, (e - b) * row);
}

std::string ReadRows(const LmHeadSource& s, int64_t b, int64_t e) {
  std::string out((e - b) * s.hidden_size * DTypeSize(s.dtype), '\0');
  absl::Status st = ReadLmHeadRows(s, b, e, out.data());
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

class LmHeadSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "/lm_head_source_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::vector<v1::Tensor>& tensors) {
    const std::string path = dir_ + "/" + name;
    EXPECT_TRUE(WriteSafetensors(path, tensors).ok());
    return path;
  }
  std::string WriteText(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  std::string dir_;
  const v1::Tensor embed_ = MakeTensor(kTiedEmbeddingTensor, v1::BF16, {6, 4}, 1);
  const v1::Tensor norm_ = MakeTensor("model.norm.weight", v1::F32, {4}, 2);
  const v1::Tensor lm_head_ = MakeTensor(kLmHeadTensor, v1::BF16, {6, 4}, 3);
};

TEST_F(LmHeadSourceTest, SingleFileDefaultTensorBf16) {
  const std::string path = Write("model.safetensors", {embed_, lm_head_, norm_});
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(path);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->file, path);
  EXPECT_EQ(s->tensor, "lm_head.weight");
  EXPECT_EQ(s->dtype, v1::BF16);
  EXPECT_EQ(s->vocab_size, 6);
  EXPECT_EQ(s->hidden_size, 4);
  EXPECT_FALSE(s->tied_embeddings);
  EXPECT_EQ(ReadRows(*s, 2, 5), Rows(lm_head_, 2, 5));
  EXPECT_EQ(ReadRows(*s, 0, 6), lm_head_.data());
  EXPECT_TRUE(ReadLmHeadRows(*s, 3, 3, nullptr).ok());  // empty range
  char buf[64];
  for (auto [b, e] : {std::pair{5, 7}, {-1, 2}, {4, 3}})
    EXPECT_EQ(ReadLmHeadRows(*s, b, e, buf).code(), absl::StatusCode::kInvalidArgument) << b << ".." << e;
}

TEST_F(LmHeadSourceTest, ShardedViaIndexAndDirectory) {
  const v1::Tensor head = MakeTensor(kLmHeadTensor, v1::F16, {7, 3}, 4);
  Write("model-00001-of-00002.safetensors", {embed_, norm_});
  const std::string shard2 = Write("model-00002-of-00002.safetensors", {head});
  // A single-file checkpoint beside the index must lose to it.
  Write("model.safetensors", {MakeTensor(kLmHeadTensor, v1::F16, {2, 3}, 5)});
  const std::string index = WriteText("model.safetensors.index.json", R"({
    "metadata": {"total_size": 1234},
    "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                   "model.norm.weight": "model-00001-of-00002.safetensors",
                   "lm_head.weight": "model-00002-of-00002.safetensors"}})");
  for (const std::string& arg : {index, dir_, dir_ + "/"}) {
    absl::StatusOr<LmHeadSource> s = ResolveLmHead(arg);
    ASSERT_TRUE(s.ok()) << arg << ": " << s.status();
    EXPECT_EQ(fs::path(s->file), fs::path(shard2)) << arg;
    EXPECT_EQ(s->tensor, "lm_head.weight");
    EXPECT_EQ(s->dtype, v1::F16);
    EXPECT_EQ(s->vocab_size, 7);
    EXPECT_EQ(s->hidden_size, 3);
    EXPECT_FALSE(s->tied_embeddings);
    EXPECT_EQ(ReadRows(*s, 1, 6), Rows(head, 1, 6));
  }
  // Explicit tensor through the index, in the other shard.
  absl::StatusOr<LmHeadSource> e = ResolveLmHead(index + ":" + kTiedEmbeddingTensor);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->vocab_size, 6);
  EXPECT_EQ(ReadRows(*e, 0, 6), embed_.data());
}

// A bias tensor of V floats, f32 values 0.5 * v - 1.
v1::Tensor BiasTensor(const std::string& name, int64_t V) {
  std::vector<float> b(V);
  for (int64_t v = 0; v < V; ++v) b[v] = 0.5f * v - 1;
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(v1::F32);
  t.add_shape(V);
  t.set_data(b.data(), b.size() * 4);
  return t;
}

TEST_F(LmHeadSourceTest, BiasBesideTheWeightInOneFileAndInAnotherShard) {
  // One file: lm_head.bias next to lm_head.weight; no config: identity scalars.
  const std::string path = Write("model.safetensors", {lm_head_, BiasTensor("lm_head.bias", 6), norm_});
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(path);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->transform.has_bias);
  EXPECT_EQ(s->bias.tensor, "lm_head.bias");
  EXPECT_EQ(s->bias.file, path);
  EXPECT_EQ(s->transform.logit_scale, 1.0);
  EXPECT_EQ(s->transform.softcap, 0.0);
  EXPECT_TRUE(s->config_file.empty());
  float got[3];
  ASSERT_TRUE(ReadLmHeadBias(*s, 2, 5, got).ok());
  EXPECT_EQ(got[0], 0.0f);
  EXPECT_EQ(got[1], 0.5f);
  EXPECT_EQ(got[2], 1.0f);
  EXPECT_EQ(ReadLmHeadBias(*s, 4, 7, got).code(), absl::StatusCode::kInvalidArgument);

  // Sharded: the index puts the bias in the other shard.
  fs::remove(path);
  Write("model-00001-of-00002.safetensors", {embed_, BiasTensor("lm_head.bias", 6)});
  Write("model-00002-of-00002.safetensors", {lm_head_});
  WriteText("model.safetensors.index.json", R"({"weight_map": {
      "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
      "lm_head.bias": "model-00001-of-00002.safetensors",
      "lm_head.weight": "model-00002-of-00002.safetensors"}})");
  s = ResolveLmHead(dir_);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->transform.has_bias);
  EXPECT_EQ(fs::path(s->bias.file).filename(), "model-00001-of-00002.safetensors");
  ASSERT_TRUE(ReadLmHeadBias(*s, 0, 1, got).ok());
  EXPECT_EQ(got[0], -1.0f);
}

TEST_F(LmHeadSourceTest, ScalarsFromConfigJsonOrFlags) {
  Write("model.safetensors", {lm_head_});
  const std::string file = dir_ + "/model.safetensors";
  // A bare file: the flags.
  LmHeadScalarFlags flags;
  flags.logit_scale = 0.25;
  flags.softcap = 30;
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(file, flags);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->transform.has_bias);
  EXPECT_EQ(s->transform.logit_scale, 0.25);
  EXPECT_EQ(s->transform.softcap, 30.0);
  // A directory with config.json: its values; equal flags are fine.
  WriteText("config.json", R"({"model_type": "granite", "logits_scaling": 4.0, "final_logit_softcapping": 30})");
  s = ResolveLmHead(dir_, flags);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->transform.logit_scale, 0.25);
  EXPECT_EQ(s->transform.softcap, 30.0);
  EXPECT_EQ(s->config_file, (fs::path(dir_) / "config.json").string());
  // The file inside that directory is a bare file: config.json is not read.
  s = ResolveLmHead(file);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->transform.logit_scale, 1.0);
  // A contradicting flag names both.
  flags.softcap = 20;
  s = ResolveLmHead(dir_, flags);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--lm-head-softcap 20"), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("final_logit_softcapping"), std::string::npos) << s.status();
  // A refused config refuses the head.
  WriteText("config.json", R"({"logit_scale": "inv_sqrt_d_model"})");
  s = ResolveLmHead(dir_);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("logit_scale"), std::string::npos) << s.status();
}

TEST_F(LmHeadSourceTest, BadBiasIsRefused) {
  Write("model.safetensors", {lm_head_, BiasTensor("lm_head.bias", 5)});
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(dir_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("lm_head.bias"), std::string::npos) << s.status();
  Write("model.safetensors", {lm_head_, MakeTensor("lm_head.bias", v1::I32, {6}, 1)});
  s = ResolveLmHead(dir_);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("lm_head.bias"), std::string::npos) << s.status();
  // config.json says there is a bias; there is none.
  Write("model.safetensors", {lm_head_});
  WriteText("config.json", R"({"lm_head_bias": true})");
  s = ResolveLmHead(dir_);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("lm_head_bias"), std::string::npos) << s.status();
}

TEST_F(LmHeadSourceTest, TiedEmbeddingsFallback) {
  Write("model.safetensors", {norm_, embed_});
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(dir_);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tensor, "model.embed_tokens.weight");
  EXPECT_TRUE(s->tied_embeddings);
  EXPECT_EQ(s->vocab_size, 6);
  EXPECT_EQ(s->hidden_size, 4);
  EXPECT_EQ(ReadRows(*s, 4, 6), Rows(embed_, 4, 6));
}

TEST_F(LmHeadSourceTest, ExplicitTensorHasNoFallback) {
  const v1::Tensor out = MakeTensor("output.weight", v1::F32, {5, 2}, 6);
  const std::string path = Write("model.safetensors", {embed_, lm_head_, out});
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(path + ":output.weight");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tensor, "output.weight");
  EXPECT_EQ(s->dtype, v1::F32);
  EXPECT_EQ(s->vocab_size, 5);
  EXPECT_EQ(s->hidden_size, 2);
  EXPECT_EQ(ReadRows(*s, 1, 3), Rows(out, 1, 3));

  absl::StatusOr<LmHeadSource> missing = ResolveLmHead(path + ":nope.weight");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.status().message()).find("nope.weight"), std::string::npos);
  EXPECT_EQ(std::string(missing.status().message()).find(kLmHeadTensor), std::string::npos) << missing.status();
  EXPECT_EQ(ResolveLmHead(path + ":").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(LmHeadSourceTest, PathWithColonIsTakenWhole) {
  const std::string path = Write("ckpt:v2.safetensors", {lm_head_});
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(path);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->file, path);
  s = ResolveLmHead(path + ":lm_head.weight");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->vocab_size, 6);
}

TEST_F(LmHeadSourceTest, NotFoundErrors) {
  EXPECT_EQ(ResolveLmHead(dir_ + "/absent.safetensors").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveLmHead(dir_ + "/absent.safetensors:lm_head.weight").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveLmHead(dir_).status().code(), absl::StatusCode::kNotFound);  // empty directory

  const std::string path = Write("model.safetensors", {norm_});
  absl::Status st = ResolveLmHead(path).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  for (const char* want : {kLmHeadTensor, kTiedEmbeddingTensor, path.c_str()})
    EXPECT_NE(std::string(st.message()).find(want), std::string::npos) << st;

  const std::string index =
      WriteText("model.safetensors.index.json", R"({"weight_map": {"lm_head.weight": "missing-shard.safetensors"}})");
  st = ResolveLmHead(index).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_NE(std::string(st.message()).find("missing-shard.safetensors"), std::string::npos) << st;

  // The index claims a tensor its shard lacks.
  WriteText("model.safetensors.index.json", R"({"weight_map": {"lm_head.weight": "model.safetensors"}})");
  EXPECT_EQ(ResolveLmHead(dir_).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LmHeadSourceTest, InvalidTensorsAndIndex) {
  const std::string one_d = Write("a.safetensors", {MakeTensor(kLmHeadTensor, v1::F32, {8}, 7)});
  const std::string empty = Write("b.safetensors", {MakeTensor(kLmHeadTensor, v1::F32, {0, 4}, 7)});
  const std::string ints = Write("c.safetensors", {MakeTensor(kLmHeadTensor, v1::I64, {3, 2}, 7)});
  for (const std::string& path : {one_d, empty, ints})
    EXPECT_EQ(ResolveLmHead(path).status().code(), absl::StatusCode::kInvalidArgument) << path;
  EXPECT_EQ(ResolveLmHead(WriteText("model.safetensors.index.json", "{not json")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveLmHead(WriteText("x.index.json", R"({"metadata": {}})")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveLmHead(WriteText("bad.safetensors", std::string("\x10\0\0\0\0\0\0\0{}", 10))).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(LmHeadSourceTest, TruncatedFile) {
  const std::string path = Write("model.safetensors", {embed_, lm_head_});
  absl::StatusOr<LmHeadSource> s = ResolveLmHead(path);
  ASSERT_TRUE(s.ok()) << s.status();
  fs::resize_file(path, fs::file_size(path) - 5);
  // Resolved before the cut: reading the last rows meets the end of the file.
  EXPECT_EQ(ReadRows(*s, 0, 2), Rows(lm_head_, 0, 2));
  std::string buf(6 * 4 * 2, '\0');
  EXPECT_EQ(ReadLmHeadRows(*s, 0, 6, buf.data()).code(), absl::StatusCode::kDataLoss);
  // Resolved after: the header's offsets no longer fit.
  absl::Status st = ResolveLmHead(path).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("malformed safetensors"), std::string::npos) << st;
  fs::remove(path);
  EXPECT_EQ(ReadLmHeadRows(*s, 0, 1, buf.data()).code(), absl::StatusCode::kNotFound);
}

TEST_F(LmHeadSourceTest, ReadSafetensorsHeaderMatchesParseSafetensors) {
  const std::vector<v1::Tensor> tensors = {norm_, MakeTensor("ids", v1::I64, {3}, 8), lm_head_,
                                           MakeTensor("scalar", v1::F16, {}, 9), embed_};
  const std::string path = dir_ + "/m.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());
  std::ostringstream bytes;
  bytes << std::ifstream(path, std::ios::binary).rdbuf();
  absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes.str());
  absl::StatusOr<SafetensorsHeader> header = ReadSafetensorsHeader(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->metadata, file->metadata);
  EXPECT_EQ(header->metadata.at("format"), "pt");
  ASSERT_EQ(header->entries.size(), tensors.size());
  ASSERT_EQ(file->tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsEntry& e = header->entries[i];
    const v1::Tensor& t = file->tensors[i];
    EXPECT_EQ(e.name, tensors[i].name());
    EXPECT_EQ(e.name, t.name());
    EXPECT_EQ(e.dtype, t.dtype());
    EXPECT_EQ(e.shape, std::vector<int64_t>(t.shape().begin(), t.shape().end()));
    EXPECT_EQ(bytes.str().substr(header->data_start + e.begin, e.end - e.begin), t.data());
    EXPECT_EQ(t.data(), tensors[i].data());
  }
  EXPECT_EQ(header->Find("ids"), &header->entries[1]);
  EXPECT_EQ(header->Find("absent"), nullptr);

  // Same errors, prefixed with the path.
  const std::string cut = bytes.str().substr(0, bytes.str().size() - 3);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << cut;
  absl::Status parse = ParseSafetensors(cut).status(), read = ReadSafetensorsHeader(path).status();
  EXPECT_EQ(read.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(read.code(), parse.code());
  EXPECT_EQ(std::string(read.message()), path + ": " + std::string(parse.message()));
  EXPECT_EQ(ReadSafetensorsHeader(dir_ + "/absent").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace logprob
