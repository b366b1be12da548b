// logprob_kernel_bench: single-core throughput of the CPU row kernel
// (ComputePartial + CombinePartials over whole rows), in logits/s, for
// float32 / bfloat16 / float16 rows of V = 32000 and 151936, token
// logprobs alone and with entropy + top-20; bf16 also with entropy alone
// and with entropy + log_sum_sq_probs + mean_logits + is_top1 (what TRL's
// fused head asks for).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "common/dtype.h"
#include "worker/kernels/row_stats.h"

namespace logprob::kernels {
namespace {

constexpr int kRows = 16;

/// kRows random rows of V logits in `dtype` (raw bytes).
std::vector<char> MakeRows(DType dtype, int64_t V) {
  std::mt19937 gen(1);
  std::normal_distribution<float> dist(0.f, 3.f);
  const size_t es = DTypeSize(dtype);
  std::vector<char> out(static_cast<size_t>(V) * kRows * es);
  for (size_t i = 0; i < static_cast<size_t>(V) * kRows; ++i) {
    const float f = dist(gen);
    if (dtype == v1::F32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == v1::BF16 ? FloatToBf16(f) : FloatToF16(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

/// What a benchmark asks of every row besides the token logprob.
enum class Mode { kLogprobs, kEntropyTop20, kEntropy, kEntropyExtras };

void BM_Row(benchmark::State& state, DType dtype, Mode mode) {
  const int64_t V = state.range(0);
  const auto rows = MakeRows(dtype, V);
  StatsSpec spec;
  spec.vocab_size = V;
  spec.entropy = mode != Mode::kLogprobs;
  spec.topk = mode == Mode::kEntropyTop20 ? 20 : 0;
  spec.log_sum_sq_probs = spec.mean_logits = spec.is_top1 = mode == Mode::kEntropyExtras;
  const bool full = mode == Mode::kEntropyTop20;
  std::vector<uint32_t> rec(PartialWords(spec));
  std::vector<float> scratch(kPartialScratchFloats);
  std::vector<float> topk_lp(20);
  std::vector<int64_t> topk_id(20);
  float lp = 0, ent = 0, lss = 0, mean = 0;
  int32_t top1 = 0;
  RowOutput out{&lp, spec.entropy ? &ent : nullptr, full ? topk_lp.data() : nullptr, full ? topk_id.data() : nullptr,
                nullptr};
  out.log_sum_sq_probs = &lss;
  out.mean_logits = &mean;
  out.is_top1 = &top1;
  const size_t es = DTypeSize(dtype);
  for (auto _ : state) {
    for (int r = 0; r < kRows; ++r) {
      SliceRow row;
      row.logits = rows.data() + static_cast<size_t>(r) * V * es;
      row.target = (r * 7919) % V;
      ComputePartial(dtype, row, 0, V, spec, rec.data(), scratch.data());
      const uint32_t* p = rec.data();
      CombinePartials(&p, 1, spec, true, out);
    }
    benchmark::DoNotOptimize(lp);
  }
  state.SetItemsProcessed(state.iterations() * kRows * V);
  state.counters["logits_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * kRows * V, benchmark::Counter::kIsRate);
}

void Args(benchmark::internal::Benchmark* b) { b->Arg(32000)->Arg(151936)->Unit(benchmark::kMillisecond); }

BENCHMARK_CAPTURE(BM_Row, f32_logprobs, v1::F32, Mode::kLogprobs)->Apply(Args);
BENCHMARK_CAPTURE(BM_Row, f32_entropy_top20, v1::F32, Mode::kEntropyTop20)->Apply(Args);
BENCHMARK_CAPTURE(BM_Row, bf16_logprobs, v1::BF16, Mode::kLogprobs)->Apply(Args);
BENCHMARK_CAPTURE(BM_Row, bf16_entropy_top20, v1::BF16, Mode::kEntropyTop20)->Apply(Args);
BENCHMARK_CAPTURE(BM_Row, bf16_entropy, v1::BF16, Mode::kEntropy)->Apply(Args);
BENCHMARK_CAPTURE(BM_Row, bf16_entropy_extras, v1::BF16, Mode::kEntropyExtras)->Apply(Args);
BENCHMARK_CAPTURE(BM_Row, f16_logprobs, v1::F16, Mode::kLogprobs)->Apply(Args);
BENCHMARK_CAPTURE(BM_Row, f16_entropy_top20, v1::F16, Mode::kEntropyTop20)->Apply(Args);

}  // namespace
}  // namespace logprob::kernels

BENCHMARK_MAIN();
