// Batch invariance through live servers with --backend cuda, the GPU twin
// of tests/server_batching_test.cc: the same probe rows (hidden states, and
// bf16 logits) embedded at offsets 0, 1, 17 and 300 of requests of M scored
// rows, M in {1, 7, 16, 300, 1024, 4133, 8141} (logits: up to 1024), with
// different random rows around them, give bitwise-identical token
// logprobs, entropy and top-5 whatever the request; first one request at a
// time, then all at once (so the server batches them together, in
// whatever combination the timing gives). One worker, and two workers
// sharing the GPU (Gloo; token- and vocab-parallel). Skips (GTEST_SKIP)
// without a usable CUDA device.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <random>
#include <tuple>

#include "common/dtype.h"
#include "tests/test_support.h"
#include "worker/cuda/device_info.h"

namespace logprob::testing {
namespace {

constexpr int64_t kV = 32000, kH = 1024;
constexpr int kProbes = 3, kTopk = 5;

bool HaveGpu() { return cuda::DeviceCount().ok(); }

/// bf16 normal(0, scale) values of one row, from `seed`.
std::vector<uint16_t> RandomRow(int64_t width, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<uint16_t> row(width);
  for (auto& x : row) x = FloatToBf16(normal(rng));
  return row;
}

/// A packed request of one sequence of M + 1 rows of `input` ("logits" or
/// "hidden_states", [M + 1, width] bf16), so M scored rows (next_token:
/// row t scores input_ids[t + 1]); probe row p sits at row offset + p (when
/// < M) with its fixed values and target, every other row is random
/// (seeded by M and offset). Entropy and top-5 on.
v1::ScoreRequest ProbeRequest(const std::string& input, int64_t width, int64_t M, int64_t offset) {
  const float scale = input == "logits" ? 3.f : 1.f;
  const int64_t T = M + 1;
  std::vector<uint16_t> values(static_cast<size_t>(T * width));
  std::vector<int64_t> ids(T);
  std::mt19937 rng(static_cast<uint32_t>(M * 1000 + offset));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = t - offset;
    const bool probe = p >= 0 && p < kProbes && t < M;
    const auto row = RandomRow(width, scale, probe ? 7 + static_cast<uint32_t>(p) : static_cast<uint32_t>(rng()));
    std::memcpy(values.data() + t * width, row.data(), width * 2);
    ids[t] = static_cast<int64_t>(rng() % kV);
  }
  for (int p = 0; p < kProbes && offset + p < M; ++p) ids[offset + p + 1] = (p * 7919 + 13) % kV;
  const int64_t cu[2] = {0, T};
  v1::ScoreRequest req;
  auto add = [&](const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data, size_t bytes) {
    v1::Tensor* t = req.add_inputs();
    t->set_name(name);
    t->set_dtype(dtype);
    for (int64_t d : shape) t->add_shape(d);
    t->set_data(data, bytes);
  };
  add(input, v1::BF16, {T, width}, values.data(), values.size() * 2);
  add("input_ids", v1::I64, {T}, ids.data(), ids.size() * 8);
  add("cu_seqlens", v1::I64, {2}, cu, sizeof cu);
  req.mutable_options()->set_entropy(true);
  req.mutable_options()->set_topk(kTopk);
  return req;
}

/// The raw bytes of output row `row` (token logprob, entropy, top-k values
/// and ids) of a response with M scored rows, or "" if an output is
/// missing or has the wrong size.
std::string RowBytes(const v1::ScoreResponse& r, int64_t M, int64_t row) {
  std::string out;
  for (const auto& [name, width, elem] : {std::tuple<const char*, int64_t, int64_t>{"token_logprobs", 1, 4},
                                          {"entropy", 1, 4},
                                          {"topk_logprobs", kTopk, 4},
                                          {"topk_indices", kTopk, 8}}) {
    const v1::Tensor* t = FindOutput(r, name);
    if (!t || static_cast<int64_t>(t->data().size()) != M * width * elem) return "";
    out += t->data().substr(row * width * elem, width * elem);
  }
  return out;
}

struct Case {
  std::string input;
  int64_t M, offset;
  v1::ScoreRequest request;
  std::string label() const { return input + " M=" + std::to_string(M) + " offset=" + std::to_string(offset); }
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const auto& [input, width, sizes] :
       {std::tuple<std::string, int64_t, std::vector<int64_t>>{"hidden_states", kH, {1, 7, 16, 300, 1024, 4133, 8141}},
        // [1025, 32000] bf16 logits are 66 MB; larger M only repeats that.
        {"logits", kV, {1, 7, 16, 300, 1024}}})
    for (int64_t M : sizes)
      for (int64_t offset : {0, 1, 17, 300})
        if (offset < M) cases.push_back({input, M, offset, ProbeRequest(input, width, M, offset)});
  return cases;
}

/// Checks every probe row of `response` against the first one seen
/// (`first`: per input kind and probe, the bytes and where they came from).
void ExpectProbesMatch(const Case& c, const v1::ScoreResponse& response,
                       std::map<std::string, std::pair<std::string, std::string>>* first) {
  for (int p = 0; p < kProbes && c.offset + p < c.M; ++p) {
    SCOPED_TRACE("probe " + std::to_string(p));
    const std::string bytes = RowBytes(response, c.M, c.offset + p);
    ASSERT_FALSE(bytes.empty()) << "outputs missing or of the wrong size";
    float lp, ent;
    std::memcpy(&lp, bytes.data(), 4);
    std::memcpy(&ent, bytes.data() + 4, 4);
    EXPECT_TRUE(std::isfinite(lp) && lp <= 0) << "token logprob " << lp;
    EXPECT_TRUE(std::isfinite(ent) && ent >= 0) << "entropy " << ent;
    const std::string key = c.input + " probe " + std::to_string(p);
    auto it = first->find(key);
    if (it == first->end()) {
      first->emplace(key, std::make_pair(bytes, c.label()));
      continue;
    }
    EXPECT_TRUE(bytes == it->second.first) << "differs from the same row in " << it->second.second;
  }
}

class CudaServerBatching : public ::testing::TestWithParam<std::tuple<int, std::string>> {
 protected:
  static void TearDownTestSuite() {
    if (!lm_head_.empty()) std::filesystem::remove(lm_head_);
    lm_head_.clear();
  }
  /// The random bf16 lm_head [kV, kH] file, written on first use.
  static const std::string& LmHead() {
    if (lm_head_.empty()) {
      lm_head_ = ::testing::TempDir() + "/cuda_batching_lm_head." + std::to_string(getpid()) + ".safetensors";
      const absl::Status st = WriteRandomLmHead(lm_head_, kV, kH, 21);
      EXPECT_TRUE(st.ok()) << st;
    }
    return lm_head_;
  }
  static std::string lm_head_;
};
std::string CudaServerBatching::lm_head_;

TEST_P(CudaServerBatching, SameRowsGiveBitwiseIdenticalOutputsInEveryBatch) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device: " << cuda::DeviceCount().status().message();
  const auto [workers, layout] = GetParam();
  auto server = ServerProcess::Start(
      workers, {"--backend", "cuda", "--comm", "gloo", "--parallelism", layout, "--lm-head", LmHead()});
  ASSERT_TRUE(server);
  auto stub = server->NewStub();
  const std::vector<Case> cases = Cases();
  const auto score = [&](const Case& c, v1::ScoreResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
    return stub->Score(&ctx, c.request, resp);
  };

  // One request at a time.
  std::map<std::string, std::pair<std::string, std::string>> first;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label() + " alone");
    v1::ScoreResponse resp;
    const grpc::Status st = score(c, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ExpectProbesMatch(c, resp, &first);
  }
  // All at once: the server batches them in combinations that depend on
  // timing; the probe rows must not notice.
  std::vector<std::future<std::pair<grpc::Status, v1::ScoreResponse>>> together;
  for (const Case& c : cases)
    together.push_back(std::async(std::launch::async, [&score, &c] {
      v1::ScoreResponse resp;
      grpc::Status st = score(c, &resp);
      return std::make_pair(st, resp);
    }));
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].label() + " together");
    const auto [st, resp] = together[i].get();
    ASSERT_TRUE(st.ok()) << st.error_message();
    ExpectProbesMatch(cases[i], resp, &first);
  }
}

INSTANTIATE_TEST_SUITE_P(Workers, CudaServerBatching,
                         ::testing::Values(std::make_tuple(1, std::string("token")),
                                           std::make_tuple(2, std::string("token")),
                                           std::make_tuple(2, std::string("vocab"))));

}  // namespace
}  // namespace logprob::testing
