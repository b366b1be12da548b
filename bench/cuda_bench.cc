// logprob_cuda_bench: the CUDA backend on one GPU.
//
//   logits  bf16 logits [T, V] already on the device: the row kernel
//           (LaunchRowPartials) for token logprobs alone and with entropy +
//           top-20; bytes/s and the fraction of peak DRAM bandwidth (from
//           cudaDeviceProp memory clock and bus width, or --peak-gbs).
//   hidden  hidden states [T, H] bf16 and an lm_head [V, H] bf16:
//           CudaBackend::HiddenPartials (chunked cuBLASLt GEMM feeding the
//           row kernel; hidden states uploaded from the host) against the
//           baseline that materialises the full [T, V] f32 logits with one
//           GEMM and then runs an in-place log_softmax + target gather
//           (bench/log_softmax_baseline.cu); TFLOP/s
//           (2 T V H / s), fraction of --peak-tflops (default 989, H100
//           SXM dense bf16), and peak device memory of each (cudaMemGetInfo).
//
//   logprob_cuda_bench [--mode logits|hidden|all] [--t 8192] [--v 151936]
//                      [--h 4096] [--reps 5] [--peak-gbs G] [--peak-tflops 989]
//                      [--chunk-mib 256]
// Exits 1 with a clear message when no CUDA device is usable.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "bench/log_softmax_baseline.h"
#include "common/dtype.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/device_info.h"
#include "worker/cuda/lm_head_gemm_cublaslt.h"
#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {
namespace {

struct Config {
  std::string mode = "all";
  int64_t T = 8192, V = 151936, H = 4096;
  int reps = 5;
  double peak_gbs = 0, peak_tflops = 989;
  size_t chunk_mib = 256;
};

#define BENCH_CHECK(call)                                                \
  do {                                                                   \
    if (cudaError_t _e = (call); _e != cudaSuccess) {                    \
      std::cerr << #call << ": " << cudaGetErrorString(_e) << std::endl; \
      std::exit(1);                                                      \
    }                                                                    \
  } while (0)

/// Row-kernel arguments over `rows` device rows of V logits of `type`.
RowBlockArgs DeviceRows(const void* logits, ElemType type, int64_t rows, int64_t V, const int64_t* targets,
                        uint32_t* records) {
  RowBlockArgs a;
  a.logits = logits;
  a.type = type;
  a.row_stride = a.len = V;
  a.rows = rows;
  a.targets = targets;
  a.records = records;
  return a;
}

/// Pseudo-random bf16 bytes, scale * uniform(-1, 1) (cheap hash, no RNG state).
std::vector<char> HashBf16(size_t n, float scale, uint32_t seed) {
  std::vector<char> out(n * 2);
  for (size_t i = 0; i < n; ++i) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const uint16_t b = FloatToBf16(scale * (static_cast<float>(h & 0xffffff) / 8388608.f - 1.f));
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

size_t UsedBytes() {
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  return total - free;
}

/// Median milliseconds of `reps` runs of f (after one warm-up), by events.
template <typename F>
float TimeMs(int reps, cudaStream_t s, F&& f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  f();
  BENCH_CHECK(cudaStreamSynchronize(s));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s);
    f();
    cudaEventRecord(b, s);
    BENCH_CHECK(cudaEventSynchronize(b));
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void BenchLogits(const Config& cfg, int device) {
  const double peak = cfg.peak_gbs > 0 ? cfg.peak_gbs * 1e9 : PeakMemoryBandwidth(device);
  const size_t pattern_rows = 64, row_bytes = static_cast<size_t>(cfg.V) * 2;
  const auto pattern = HashBf16(pattern_rows * cfg.V, 8.f, 1);
  char* logits = nullptr;
  BENCH_CHECK(cudaMalloc(&logits, row_bytes * cfg.T));
  for (int64_t r = 0; r < cfg.T; r += pattern_rows)
    BENCH_CHECK(cudaMemcpy(logits + r * row_bytes, pattern.data(),
                           std::min<int64_t>(pattern_rows, cfg.T - r) * row_bytes, cudaMemcpyHostToDevice));
  std::vector<int64_t> targets(cfg.T);
  for (int64_t i = 0; i < cfg.T; ++i) targets[i] = (i * 7919) % cfg.V;
  int64_t* d_targets = nullptr;
  uint32_t* records = nullptr;
  float* sx = nullptr;
  int32_t* sid = nullptr;
  BENCH_CHECK(cudaMalloc(&d_targets, cfg.T * 8));
  BENCH_CHECK(cudaMemcpy(d_targets, targets.data(), cfg.T * 8, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMalloc(&records, cfg.T * record::Words(0, 20) * 4));
  BENCH_CHECK(cudaMalloc(&sx, cfg.T * 20 * 4));
  BENCH_CHECK(cudaMalloc(&sid, cfg.T * 20 * 4));
  std::printf("logits bf16 [%lld, %lld] on the device (%.2f GB), peak DRAM %.0f GB/s%s\n",
              static_cast<long long>(cfg.T), static_cast<long long>(cfg.V), row_bytes * cfg.T / 1e9, peak / 1e9,
              cfg.peak_gbs > 0 ? " (--peak-gbs)" : " (memory clock x bus width)");
  std::printf("%-24s %10s %12s %10s\n", "outputs", "ms", "GB/s", "of peak");
  for (bool full : {false, true}) {
    RowBlockArgs a = DeviceRows(logits, ElemType::kBF16, cfg.T, cfg.V, d_targets, records);
    a.entropy = full;
    a.topk = full ? 20 : 0;
    a.topk_scratch_x = sx;
    a.topk_scratch_id = sid;
    const float ms = TimeMs(cfg.reps, nullptr, [&] { BENCH_CHECK(LaunchRowPartials(a, nullptr)); });
    const double bps = row_bytes * cfg.T / (ms * 1e-3);
    std::printf("%-24s %10.3f %12.1f %9.1f%%\n", full ? "logprobs+entropy+top20" : "token logprobs", ms, bps / 1e9,
                peak > 0 ? 100.0 * bps / peak : 0.0);
  }
  cudaFree(logits);
  cudaFree(d_targets);
  cudaFree(records);
  cudaFree(sx);
  cudaFree(sid);
}

void BenchHidden(const Config& cfg, int device) {
  const double flops = 2.0 * cfg.T * cfg.V * cfg.H;
  LmHeadSlice slice;
  slice.dtype = v1::BF16;
  slice.rows = cfg.V;
  slice.hidden_size = cfg.H;
  slice.weight = HashBf16(static_cast<size_t>(cfg.V * cfg.H), 0.05f, 2);
  const auto hidden = HashBf16(static_cast<size_t>(cfg.T * cfg.H), 1.f, 3);
  std::vector<int64_t> targets(cfg.T);
  for (int64_t i = 0; i < cfg.T; ++i) targets[i] = (i * 7919) % cfg.V;
  std::printf("hidden states bf16 [%lld, %lld] x lm_head bf16 [%lld, %lld], peak %.0f TFLOP/s (--peak-tflops)\n",
              static_cast<long long>(cfg.T), static_cast<long long>(cfg.H), static_cast<long long>(cfg.V),
              static_cast<long long>(cfg.H), cfg.peak_tflops);
  std::printf("%-34s %10s %10s %9s %14s\n", "mode", "ms", "TFLOP/s", "of peak", "peak GPU MiB");
  {  // fused: chunked GEMM + row kernel (the worker's path)
    const size_t base = UsedBytes();
    CudaBackend::Options opts;
    opts.gemm_chunk_bytes = cfg.chunk_mib << 20;
    auto backend = CudaBackend::Create(device, &slice, opts);
    if (!backend.ok()) {
      std::cerr << backend.status() << std::endl;
      std::exit(1);
    }
    kernels::StatsSpec spec;
    std::vector<uint32_t> rec(cfg.T * kernels::PartialWords(spec));
    const BlockRows rows{cfg.T, targets.data(), nullptr};
    const float ms = TimeMs(cfg.reps, (*backend)->stream(), [&] {
      if (auto st = (*backend)->HiddenPartials(v1::BF16, hidden.data(), 0, rows, spec, rec.data()); !st.ok()) {
        std::cerr << st << std::endl;
        std::exit(1);
      }
    });
    std::printf("%-34s %10.3f %10.1f %8.1f%% %14.0f\n", "fused (chunked GEMM + row kernel)", ms,
                flops / (ms * 1e-3) / 1e12, 100.0 * flops / (ms * 1e-3) / 1e12 / cfg.peak_tflops,
                (UsedBytes() - base) / 1048576.0);
  }
  {  // baseline: full [T, V] f32 logits, then log_softmax and the target gather
    const size_t base = UsedBytes();
    auto gemm = CublasLtLmHead::Create(v1::BF16, slice.weight.data(), slice.weight.size(), cfg.V, cfg.H);
    if (!gemm.ok()) {
      std::cerr << gemm.status() << std::endl;
      std::exit(1);
    }
    char* d_hidden = nullptr;
    float* logits = nullptr;
    int64_t* d_targets = nullptr;
    float* logprobs = nullptr;
    BENCH_CHECK(cudaMalloc(&d_hidden, hidden.size()));
    BENCH_CHECK(cudaMemcpy(d_hidden, hidden.data(), hidden.size(), cudaMemcpyHostToDevice));
    BENCH_CHECK(cudaMalloc(&logits, static_cast<size_t>(cfg.T * cfg.V) * 4));
    BENCH_CHECK(cudaMalloc(&d_targets, cfg.T * 8));
    BENCH_CHECK(cudaMemcpy(d_targets, targets.data(), cfg.T * 8, cudaMemcpyHostToDevice));
    BENCH_CHECK(cudaMalloc(&logprobs, cfg.T * 4));
    const float gemm_ms = TimeMs(cfg.reps, nullptr, [&] {
      if (auto st = (*gemm)->Compute(d_hidden, cfg.T, logits, nullptr); !st.ok()) std::exit(1);
    });
    const float ms = TimeMs(cfg.reps, nullptr, [&] {
      if (auto st = (*gemm)->Compute(d_hidden, cfg.T, logits, nullptr); !st.ok()) std::exit(1);
      BENCH_CHECK(LaunchLogSoftmaxGather(logits, cfg.T, cfg.V, d_targets, logprobs, nullptr));
    });
    const double peak_mib = (UsedBytes() - base) / 1048576.0;
    std::printf("%-34s %10.3f %10.1f %8.1f%% %14.0f\n", "GEMM alone, full [T, V] f32", gemm_ms,
                flops / (gemm_ms * 1e-3) / 1e12, 100.0 * flops / (gemm_ms * 1e-3) / 1e12 / cfg.peak_tflops, peak_mib);
    std::printf("%-34s %10.3f %10.1f %8.1f%% %14.0f\n", "full GEMM then log_softmax+gather", ms,
                flops / (ms * 1e-3) / 1e12, 100.0 * flops / (ms * 1e-3) / 1e12 / cfg.peak_tflops, peak_mib);
    cudaFree(d_hidden);
    cudaFree(logits);
    cudaFree(d_targets);
    cudaFree(logprobs);
  }
}

int Main(int argc, char** argv) {
  Config cfg;
  for (BenchArgs args(argc, argv); args.Next();) {
    const std::string a = args.flag();
    auto next = [&] { return args.Value(); };
    if (a == "--mode") cfg.mode = next();
    else if (a == "--t") cfg.T = std::stoll(next());
    else if (a == "--v") cfg.V = std::stoll(next());
    else if (a == "--h") cfg.H = std::stoll(next());
    else if (a == "--reps") cfg.reps = std::stoi(next());
    else if (a == "--peak-gbs") cfg.peak_gbs = std::stod(next());
    else if (a == "--peak-tflops") cfg.peak_tflops = std::stod(next());
    else if (a == "--chunk-mib") cfg.chunk_mib = std::stoull(next());
    else {
      std::cerr << "usage: logprob_cuda_bench [--mode logits|hidden|all] [--t T] [--v V] [--h H] [--reps R] "
                   "[--peak-gbs G] [--peak-tflops F] [--chunk-mib M]"
                << std::endl;
      return 2;
    }
  }
  auto device = SelectDevice(0, 0);
  if (!device.ok()) {
    std::cerr << "logprob_cuda_bench: " << device.status().message() << " (this benchmark needs a GPU)" << std::endl;
    return 1;
  }
  std::printf("device: %s\n", DeviceDescription(*device).c_str());
  if (cfg.mode == "logits" || cfg.mode == "all") BenchLogits(cfg, *device);
  if (cfg.mode == "hidden" || cfg.mode == "all") BenchHidden(cfg, *device);
  return 0;
}

}  // namespace
}  // namespace logprob::cuda

int main(int argc, char** argv) { return logprob::cuda::Main(argc, argv); }
