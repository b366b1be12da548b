// LmHeadRegistry: a worker's held lm_head versions. Loads read (or, for a
// committed update's file in memory, map) this rank's rows; a version held
// from another file is a stale copy and is replaced; Drop forgets it.
#include "worker/heads/lm_head_registry.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "common/lm_head_source.h"
#include "common/safetensors.h"
#include "worker/scoring/cpu_backend.h"

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

// Issue 42: a worker opens only the files the front-end serves heads
// from: the heads the JoinReply named (checkpoints anywhere) and the
// committed files of the front-end's store; never a staged ".partial", a
// file beside the store, or one through "..", whatever a LoadLmHead says.
TEST(LmHeadRegistry, AWorkersRegistryOpensOnlyTheNamedHeadsAndTheStoresCommittedFiles) {
  const std::string base = ::testing::TempDir() + "/lm_head_registry_test.rule." + std::to_string(getpid());
  const std::string store = base + ".store";
  ASSERT_EQ(mkdir(store.c_str(), 0700), 0);
  const std::string startup = WriteHead(base + ".startup.safetensors", 10);
  const std::string committed = WriteHead(store + "/policy-1.safetensors", 20);
  const std::string staged = WriteHead(store + "/policy-2.safetensors.partial", 30);
  const std::string beside = WriteHead(base + ".beside.safetensors", 40);
  internal::v1::JoinReply joined;
  joined.set_lm_head_store_dir(store);
  *joined.add_lm_heads() = LoadOf("v0", startup, false);
  CpuBackend backend(1);
  LmHeadRegistry registry(backend, LmHeadPrecision::kFp32, /*rank=*/0, /*world=*/1, {}, LmHeadFetchMode::kNever,
                          LmHeadFileRule::Of(joined));
  ASSERT_TRUE(registry.Load(LoadOf("v0", startup, false)).ok());
  ASSERT_TRUE(registry.Load(LoadOf("v1", committed, true)).ok());
  // ".." out of the store names the startup file's folder, not the file itself.
  const std::string through = store + "/../" + beside.substr(beside.rfind('/') + 1);
  for (const std::string& file : {staged, beside, through}) {
    SCOPED_TRACE(file);
    const absl::StatusOr<int64_t> loaded = registry.Load(LoadOf("v9", file, false));
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kPermissionDenied) << loaded.status();
    EXPECT_NE(loaded.status().message().find("is neither a committed file of the front-end's lm_head store"),
              std::string::npos)
        << loaded.status();
  }
  // A bias file outside the rule is refused too.
  internal::v1::LmHeadLoad with_bias = LoadOf("v8", committed, true);
  with_bias.mutable_source()->set_bias_file(beside);
  with_bias.mutable_source()->set_bias_tensor(kLmHeadTensor);
  with_bias.mutable_source()->set_bias_dtype(v1::F32);
  EXPECT_EQ(registry.Load(with_bias).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(registry.size(), 2u);
  for (const std::string& f : {startup, committed, staged, beside}) std::remove(f.c_str());
  rmdir(store.c_str());
}

TEST(LmHeadRegistry, TwoVersionsOfOneNameAreTwoIdentitiesAndADropTakesOnlyItsOwn) {
  // Issue 31: a version name reused (a request still held the first) must
  // never let the release of the first drop the second.
  const std::string base = ::testing::TempDir() + "/lm_head_registry_serial." + std::to_string(getpid());
  const std::string a = WriteHead(base + ".a.safetensors", 10), b = WriteHead(base + ".b.safetensors", 20);
  CpuBackend backend(1);
  LmHeadRegistry registry(backend, LmHeadPrecision::kFp32, /*rank=*/0, /*world=*/1);
  internal::v1::LmHeadLoad first = LoadOf("v2", a, false), second = LoadOf("v2", b, false);
  first.mutable_head()->set_serial(3);
  second.mutable_head()->set_serial(5);
  ASSERT_TRUE(registry.Load(first).ok());
  ASSERT_TRUE(registry.Load(second).ok());
  EXPECT_EQ(registry.size(), 2u);
  ASSERT_NE(registry.Find(first.head()), nullptr);
  EXPECT_EQ(FirstColumn(backend, *registry.Find(first.head())), Expected(10));
  EXPECT_TRUE(registry.Drop(first.head()));
  const std::shared_ptr<const LmHeadWeights> kept = registry.Find(second.head());
  ASSERT_NE(kept, nullptr) << "the drop of serial 3 took serial 5";
  EXPECT_EQ(FirstColumn(backend, *kept), Expected(20));
  EXPECT_EQ(registry.Find(first.head()), nullptr);
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

// A head with a bias, a multiplier and a softcap: each rank reads its
// slice of the bias (rows SplitRange(V, W, rank)) and the backend's logits
// are softcap(scale * (h W^T + b)); the same version loaded again with
// another transform replaces the held copy.
TEST(LmHeadRegistry, TheTransformAndThisRanksBiasSliceApply) {
  const std::string path = ::testing::TempDir() + "/lm_head_registry_test.bias." + std::to_string(getpid());
  {
    v1::Tensor w;
    w.set_name(kLmHeadTensor);
    w.set_dtype(v1::F32);
    w.add_shape(kV);
    w.add_shape(kH);
    std::vector<float> wv, bv;
    for (int64_t r = 0; r < kV; ++r)
      for (int64_t c = 0; c < kH; ++c) wv.push_back(static_cast<float>((c + 1) * r) + 10);
    for (int64_t r = 0; r < kV; ++r) bv.push_back(100.0f * r);
    w.set_data(wv.data(), wv.size() * 4);
    v1::Tensor b;
    b.set_name("lm_head.bias");
    b.set_dtype(v1::F32);
    b.add_shape(kV);
    b.set_data(bv.data(), bv.size() * 4);
    ASSERT_TRUE(WriteSafetensors(path, {w, b}).ok());
  }
  LmHeadScalarFlags flags;
  flags.logit_scale = 0.5;
  flags.softcap = 30;
  const LmHeadSource s = ResolveLmHead(path, flags).value();
  ASSERT_TRUE(s.transform.has_bias);
  internal::v1::LmHeadLoad load = LoadOf("v1", path, false);
  load.mutable_source()->set_logit_scale(s.transform.logit_scale);
  load.mutable_source()->set_final_logit_softcapping(s.transform.softcap);
  load.mutable_source()->set_bias_file(s.bias.file);
  load.mutable_source()->set_bias_tensor(s.bias.tensor);
  load.mutable_source()->set_bias_dtype(s.bias.dtype);
  load.mutable_source()->set_bias_offset(s.bias.data_offset);
  CpuBackend backend(1);
  LmHeadRegistry registry(backend, LmHeadPrecision::kFp32, /*rank=*/1, /*world=*/2);  // rows [3, 5)
  ASSERT_TRUE(registry.Load(load).ok());
  internal::v1::LmHeadRef ref = load.head();
  std::shared_ptr<const LmHeadWeights> w = registry.Find(ref);
  ASSERT_NE(w, nullptr);
  ASSERT_EQ(w->rows(), 2);
  EXPECT_TRUE(w->transform().has_bias);
  std::vector<float> want;
  for (int64_t r = 3; r < 5; ++r) want.push_back(TransformLogit(static_cast<float>(r) + 10, 100.0f * r, 0.5f, 30.0f));
  EXPECT_EQ(FirstColumn(backend, *w), want);

  // Same file, another transform (no softcap): replaced.
  load.mutable_source()->set_final_logit_softcapping(0);
  ASSERT_TRUE(registry.Load(load).ok());
  w = registry.Find(ref);
  want.clear();
  for (int64_t r = 3; r < 5; ++r) want.push_back((static_cast<float>(r) + 10 + 100.0f * r) * 0.5f);
  EXPECT_EQ(FirstColumn(backend, *w), want);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace logprob
