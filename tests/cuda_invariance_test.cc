// Batch invariance on the GPU (docs/SPEC.md "Numbers"; the CPU twin is
// tests/server_batching_test.cc): a row's records and outputs may not
// depend on the batch size M nor on where the row sits in the batch.
// bench/batch_invariance.h embeds fixed probe rows at offsets 0, 1, 17 and
// 300 inside batches of M in {1, 7, 16, 300, 1024, 4133, 8141} (random
// filler rows around them) and compares every probe row bitwise with its
// first occurrence, through CudaBackend::HiddenItemPartials (hidden states
// in device memory and in host memory, bf16 and f32) and
// CudaBackend::SlicePartials (bf16 logits, V = 151936 and 37984).
// The CudaBackend tests skip (GTEST_SKIP) without a usable CUDA device; the
// CudaInvarianceChecker tests run everywhere and show that the check
// passes on an invariant backend and fails on one whose records depend on M.
#include <gtest/gtest.h>

#include <memory>

#include "bench/batch_invariance.h"
#include "bench/synthetic_rows.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/device_info.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scoring/cpu_backend.h"

namespace logprob {
namespace {

#define SKIP_WITHOUT_GPU()                                                           \
  do {                                                                               \
    if (auto n = cuda::DeviceCount(); !n.ok()) GTEST_SKIP() << n.status().message(); \
  } while (0)

/// Runs a check and expects it to find every probe row identical.
void ExpectInvariant(const absl::StatusOr<InvarianceResult>& r, const InvarianceOptions& o) {
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ok()) << r->Summary();
  // Every (M, offset) pair with offset < M is one batch.
  int64_t batches = 0;
  for (int64_t M : o.batch_sizes)
    for (int64_t off : o.offsets) batches += off < M;
  EXPECT_EQ(r->batches, batches);
  EXPECT_GT(r->comparisons, batches) << "the probe rows must be compared many times";
}

/// A GPU backend and, when `slice` is given, that lm_head loaded into it.
struct Gpu {
  std::unique_ptr<cuda::CudaBackend> backend;
  std::shared_ptr<const LmHeadWeights> lm_head;
  explicit operator bool() const { return backend != nullptr; }
  cuda::CudaBackend& operator*() const { return *backend; }
};
Gpu GpuBackend(const LmHeadSlice* slice, const cuda::CudaBackend::Options& opts) {
  Gpu g;
  auto b = cuda::CudaBackend::Create(0, opts);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return g;
  g.backend = std::move(*b);
  if (slice) {
    auto w = g.backend->LoadLmHead(*slice, LmHeadPrecision::kAuto);
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return Gpu{};
    g.lm_head = *std::move(w);
  }
  return g;
}

// The production shape's vocabulary (Qwen, V = 151936) with a smaller H to
// keep the lm_head upload short; the GEMM's algorithm choice depends on M.
constexpr int64_t kV = 151936, kH = 1024;

TEST(CudaInvariance, HiddenItemPartialsBf16FromDeviceMemory) {
  SKIP_WITHOUT_GPU();
  const LmHeadSlice slice = HashLmHead(kV, kH, 11);
  auto gpu = GpuBackend(&slice, {});
  ASSERT_TRUE(gpu);
  const InvarianceOptions o;
  ExpectInvariant(CheckHiddenItemInvariance(*gpu, *gpu.lm_head, v1::BF16, /*on_device=*/true, o), o);
}

TEST(CudaInvariance, HiddenItemPartialsFromHostMemoryBf16AndF32) {
  SKIP_WITHOUT_GPU();
  const LmHeadSlice slice = HashLmHead(kV, kH, 12);
  auto gpu = GpuBackend(&slice, {});
  ASSERT_TRUE(gpu);
  InvarianceOptions o;
  o.seed = 2;
  ExpectInvariant(CheckHiddenItemInvariance(*gpu, *gpu.lm_head, v1::BF16, /*on_device=*/false, o), o);
  // F32 hidden states go through the conversion kernel first.
  o.batch_sizes = {1, 7, 16, 300, 1024};
  o.spec.temperature = 0.7f;
  ExpectInvariant(CheckHiddenItemInvariance(*gpu, *gpu.lm_head, v1::F32, /*on_device=*/false, o), o);
}

TEST(CudaInvariance, HiddenItemPartialsWithSmallGemmChunks) {
  SKIP_WITHOUT_GPU();
  // 48-row GEMM chunks (when the backend sizes chunks by gemm_chunk_bytes):
  // probe rows land at every position of a chunk and in short last chunks.
  const int64_t V = 37984;
  const LmHeadSlice slice = HashLmHead(V, kH, 13);
  cuda::CudaBackend::Options opts;
  opts.gemm_chunk_bytes = 48 * V * 4;
  auto gpu = GpuBackend(&slice, opts);
  ASSERT_TRUE(gpu);
  InvarianceOptions o;
  o.seed = 3;
  o.offsets = {0, 1, 17, 47, 48, 300};
  ExpectInvariant(CheckHiddenItemInvariance(*gpu, *gpu.lm_head, v1::BF16, /*on_device=*/true, o), o);
}

TEST(CudaInvariance, SlicePartialsBf16Logits) {
  SKIP_WITHOUT_GPU();
  auto gpu = GpuBackend(nullptr, {});
  ASSERT_TRUE(gpu);
  InvarianceOptions o;
  o.seed = 4;
  // [8141, 37984] bf16 is 618 MB of host logits per batch: the full list.
  ExpectInvariant(CheckSliceInvariance(*gpu, v1::BF16, 37984, o), o);
  // V = 151936 up to M = 1024 (311 MB), across staging sub-blocks.
  o.batch_sizes = {1, 7, 16, 300, 1024};
  ExpectInvariant(CheckSliceInvariance(*gpu, v1::BF16, 151936, o), o);
}

TEST(CudaInvariance, SlicePartialsAcrossSmallStagingBlocks) {
  SKIP_WITHOUT_GPU();
  cuda::CudaBackend::Options opts;
  opts.staging_bytes = 1 << 20;  // 13 rows of V = 37984 bf16 per sub-block
  auto gpu = GpuBackend(nullptr, opts);
  ASSERT_TRUE(gpu);
  InvarianceOptions o;
  o.seed = 5;
  o.batch_sizes = {1, 7, 16, 300, 1024};
  o.spec.topk = 5;
  ExpectInvariant(CheckSliceInvariance(*gpu, v1::F16, 37984, o), o);
}

/// A backend for checking the checker: the CPU backend's records (logits;
/// hidden states one row at a time, so invariant by construction), with
/// the s word of every row changed in batches larger than `perturb_above`.
class PerturbingBackend final : public ScoringBackend {
 public:
  PerturbingBackend(CpuBackend* cpu, int64_t perturb_above) : cpu_(cpu), perturb_above_(perturb_above) {}
  std::string name() const override { return "perturbing"; }
  absl::Status SlicePartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                             uint32_t* records) override {
    LOGPROB_RETURN_IF_ERROR(cpu_->SlicePartials(block, rows, spec, records));
    Perturb(rows.count, spec, records);
    return absl::OkStatus();
  }
  absl::Status FilteredRowPartials(const LogitsBlock& block, const BlockRows& rows, const kernels::StatsSpec& spec,
                                   const SamplingFilter& filter, uint32_t* records) override {
    return cpu_->FilteredRowPartials(block, rows, spec, filter, records);
  }
  absl::StatusOr<std::shared_ptr<const LmHeadWeights>> LoadLmHead(LmHeadSlice slice,
                                                                  LmHeadPrecision precision) override {
    return cpu_->LoadLmHead(std::move(slice), precision);
  }
  absl::Status HiddenPartials(const LmHeadWeights& w, DType dtype, const void* hidden, int64_t vocab_begin,
                              const BlockRows& rows, const kernels::StatsSpec& spec, uint32_t* records) override {
    return cpu_->HiddenPartials(w, dtype, hidden, vocab_begin, rows, spec, records);
  }
  absl::Status HiddenLogits(const LmHeadWeights& w, DType dtype, const void* hidden, int64_t M,
                            float* logits) override {
    return cpu_->HiddenLogits(w, dtype, hidden, M, logits);
  }
  bool OnePassHidden(const Communicator& comm) const override { return comm.size() == 1; }
  absl::Status HiddenItemPartials(const LmHeadWeights& lm_head, const HiddenItemRows& item, Communicator& comm,
                                  const kernels::StatsSpec& spec, uint32_t* own_records) override {
    if (comm.size() != 1 || item.own_on_device) return absl::UnimplementedError("W = 1 host rows only");
    const size_t words = kernels::PartialWords(spec), row_bytes = lm_head.hidden_size() * DTypeSize(item.dtype);
    for (int64_t i = 0; i < item.rows.count; ++i) {
      const BlockRows one{1, item.rows.targets + i,
                          item.rows.gather_ids ? item.rows.gather_ids + i * spec.gather_k : nullptr};
      LOGPROB_RETURN_IF_ERROR(cpu_->HiddenPartials(lm_head, item.dtype,
                                                   static_cast<const char*>(item.own) + i * row_bytes, item.vocab_begin,
                                                   one, spec, own_records + i * words));
    }
    Perturb(item.rows.count, spec, own_records);
    return absl::OkStatus();
  }

 private:
  void Perturb(int64_t M, const kernels::StatsSpec& spec, uint32_t* records) const {
    if (M <= perturb_above_) return;
    for (int64_t i = 0; i < M; ++i) records[i * kernels::PartialWords(spec) + record::kSWord] ^= 1u;
  }
  CpuBackend* cpu_;
  int64_t perturb_above_;
};

InvarianceOptions SmallOptions() {
  InvarianceOptions o;
  o.batch_sizes = {1, 7, 16, 40};
  o.offsets = {0, 1, 17};
  return o;
}

TEST(CudaInvarianceChecker, PassesOnTheCpuRowKernelAndCatchesBatchDependentRecords) {
  CpuBackend cpu;
  const InvarianceOptions o = SmallOptions();
  PerturbingBackend invariant(&cpu, /*perturb_above=*/1 << 30);
  ExpectInvariant(CheckSliceInvariance(invariant, v1::BF16, 3001, o), o);
  PerturbingBackend dependent(&cpu, /*perturb_above=*/16);
  const auto r = CheckSliceInvariance(dependent, v1::BF16, 3001, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->ok());
  // Probe rows in the M = 40 batches (3 offsets x 3 probe rows) differ.
  EXPECT_EQ(r->mismatches, 9) << r->Summary();
  EXPECT_NE(r->Summary().find("M=40 offset=0 (row 0) differs from M=1 offset=0"), std::string::npos) << r->Summary();
}

TEST(CudaInvarianceChecker, HiddenItemPathPassesAndCatchesBatchDependentRecords) {
  const int64_t V = 700, H = 48;
  const LmHeadSlice slice = HashLmHead(V, H, 14);
  CpuBackend cpu;
  auto w = cpu.LoadLmHead(slice, LmHeadPrecision::kAuto);
  ASSERT_TRUE(w.ok()) << w.status();
  const InvarianceOptions o = SmallOptions();
  PerturbingBackend invariant(&cpu, 1 << 30);
  ExpectInvariant(CheckHiddenItemInvariance(invariant, **w, v1::BF16, /*on_device=*/false, o), o);
  PerturbingBackend dependent(&cpu, 7);
  const auto r = CheckHiddenItemInvariance(dependent, **w, v1::BF16, /*on_device=*/false, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->ok());
  EXPECT_NE(r->Summary().find("record word"), std::string::npos) << r->Summary();
  // A backend without the one-pass path is an error, not a pass.
  const auto unimplemented = CheckHiddenItemInvariance(cpu, **w, v1::BF16, false, o);
  EXPECT_EQ(unimplemented.status().code(), absl::StatusCode::kUnimplemented) << unimplemented.status();
}

}  // namespace
}  // namespace logprob
