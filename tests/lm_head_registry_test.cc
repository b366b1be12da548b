// LmHeadRegistry: a worker's held lm_head versions. Loads read (or, for a
// committed update's file in memory, map) this rank's rows; a version held
// from another file is a stale copy and is replaced; Drop forgets it.
#include "worker/lm_head_registry.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/lm_head_source.h"
#include "common/safetensors.h"
#include "worker/cpu_backend.h"

namespace logprob {
namespace {

constexpr int64_t kV = 5, kH = 3;

/// An F32 lm_head [kV, kH] whose row r is {r + salt, 2r + salt, 3r + salt}.
std::string WriteHead(const std::string& path, float salt) {
  v1::Tensor t;
  t.set_name(kLmHeadTensor);
  t.set_dtype(v1::F32);
  t.add_shape(kV);
  t.add_shape(kH);
  std::vector<float> w;
  for (int64_t r = 0; r < kV; ++r)
    for (int64_t c = 0; c < kH; ++c) w.push_back(static_cast<float>((c + 1) * r) + salt);
  t.set_data(std::string(reinterpret_cast<const char*>(w.data()), w.size() * sizeof(float)));
  EXPECT_TRUE(WriteSafetensors(path, {t}).ok());
  return path;
}

internal::v1::LmHeadLoad LoadOf(const std::string& version, const std::string& path, bool immutable) {
  const LmHeadSource s = ResolveLmHead(path).value();
  internal::v1::LmHeadLoad load;
  load.mutable_head()->set_name("policy");
  load.mutable_head()->set_version(version);
  auto* src = load.mutable_source();
  src->set_file(s.file);
  src->set_tensor(s.tensor);
  src->set_dtype(s.dtype);
  src->set_vocab_size(s.vocab_size);
  src->set_hidden_size(s.hidden_size);
  src->set_data_offset(s.data_offset);
  src->set_immutable(immutable);
  return load;
}

/// Column 0 of the held weights' rows: the logits of the hidden state {1, 0, 0}.
std::vector<float> FirstColumn(CpuBackend& backend, const LmHeadWeights& w) {
  const float hidden[kH] = {1, 0, 0};
  std::vector<float> logits(static_cast<size_t>(w.rows()));
  EXPECT_TRUE(backend.HiddenLogits(w, v1::F32, hidden, 1, logits.data()).ok());
  return logits;
}

std::vector<float> Expected(float salt) {
  std::vector<float> v;
  for (int64_t r = 0; r < kV; ++r) v.push_back(static_cast<float>(r) + salt);
  return v;
}

TEST(LmHeadRegistry, AVersionHeldFromAnotherFileIsStaleAndIsReplaced) {
  const std::string base = ::testing::TempDir() + "/lm_head_registry_test." + std::to_string(getpid());
  const std::string a = WriteHead(base + ".a.safetensors", 10), b = WriteHead(base + ".b.safetensors", 20);
  CpuBackend backend(1);
  LmHeadRegistry registry(backend, LmHeadPrecision::kFp32, /*rank=*/0, /*world=*/1);
  internal::v1::LmHeadRef ref;
  ref.set_name("policy");
  ref.set_version("v1");

  ASSERT_TRUE(registry.Load(LoadOf("v1", a, false)).ok());
  const std::shared_ptr<const LmHeadWeights> first = registry.Find(ref);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(FirstColumn(backend, *first), Expected(10));
  // The same file again: held, nothing read.
  ASSERT_TRUE(registry.Load(LoadOf("v1", a, false)).ok());
  EXPECT_EQ(registry.Find(ref), first);
  // The same name from another file (this worker missed the drop of the
  // first v1, and v1 was committed again): the new bytes serve.
  ASSERT_TRUE(registry.Load(LoadOf("v1", b, false)).ok());
  const std::shared_ptr<const LmHeadWeights> second = registry.Find(ref);
  ASSERT_NE(second, nullptr);
  EXPECT_NE(second, first);
  EXPECT_EQ(FirstColumn(backend, *second), Expected(20));
  EXPECT_EQ(FirstColumn(backend, *first), Expected(10)) << "an item still holding the old weights keeps them";
  EXPECT_EQ(registry.size(), 1u);
  EXPECT_TRUE(registry.Drop(ref));
  EXPECT_EQ(registry.Find(ref), nullptr);
  EXPECT_FALSE(registry.Drop(ref));
  std::remove(a.c_str());
  std::remove(b.c_str());
}

TEST(LmHeadRegistry, AnImmutableFileInMemoryIsMappedAndScoresLikeACopy) {
  const std::string path = WriteHead("/dev/shm/lm_head_registry_test." + std::to_string(getpid()), 30);
  CpuBackend backend(1);
  LmHeadRegistry registry(backend, LmHeadPrecision::kFp32, 0, 1);
  ASSERT_TRUE(registry.Load(LoadOf("mapped", path, true)).ok());
  ASSERT_TRUE(registry.Load(LoadOf("copied", path, false)).ok());
  std::remove(path.c_str());  // a mapping keeps the file's pages
  for (const char* version : {"mapped", "copied"}) {
    internal::v1::LmHeadRef ref;
    ref.set_name("policy");
    ref.set_version(version);
    const auto w = registry.Find(ref);
    ASSERT_NE(w, nullptr) << version;
    EXPECT_EQ(FirstColumn(backend, *w), Expected(30)) << version;
  }
}

}  // namespace
}  // namespace logprob
