// logprob_cuda_bench: the CUDA backend on one GPU, against baselines
// measured in the same run (interleaved rounds, medians; issue 14 targets
// printed next to each figure, with PASS / FAIL).
//
//   logits     bf16 logits [T, V] already on the device, for each V of --v:
//              a device-to-device cudaMemcpyAsync of the same bytes (copy
//              bandwidth = bytes read + written / time, as CUDA's
//              bandwidthTest counts it), then the row kernel
//              (LaunchRowPartials) for token logprobs alone and with
//              entropy + top-20: bytes read / time and its fraction of the
//              copy bandwidth. CUDA-event timing.
//   hidden     hidden states [T, H] bf16 x lm_head [V, H] bf16, for each V:
//              (a) the cuBLASLt GEMM alone (CublasLtLmHead::Compute) to f32
//                  logits in chunks of the backend's chunk rows: the
//                  baseline; (a1) the same as one [T, V] GEMM;
//              (b) CudaBackend::HiddenItemPartials (one pass, W = 1) with
//                  the hidden states in device memory (cudaMalloc);
//              (c) from pinned host memory (cudaMallocHost); (c2) from
//                  malloc'd memory page-locked by RegisterHostMemory;
//              (d) from pageable host memory;
//              (e) CudaBackend::HiddenPartials, pageable: since there is
//                  one CUDA fused path, the one-pass path of a one-rank
//                  item, so (e) costs as (d);
//              (f) one [T, V] GEMM, then an in-place f32 log_softmax and
//                  the target gather (bench/log_softmax_baseline.cu).
//              Wall-clock times of the synchronous calls; TFLOP/s =
//              2 T V H / s; ratio = time of (a) / time of the case. Then
//              checks that (b), (c), (c2), (d) give bitwise-identical
//              records and that (b), (e) and (f) agree on the token
//              logprobs.
//   invariance bench/batch_invariance.h at this shape (H, first V of --v):
//              HiddenItemPartials records of probe rows bitwise identical
//              in batches of M in --inv-m at offsets --inv-offsets, from
//              device and from host memory. Exit status 1 on a mismatch or
//              an error.
//   all        logits, hidden, invariance.
//
//   logprob_cuda_bench [--mode logits|hidden|invariance|all] [--t 8192]
//       [--v 151936,37984] [--h 4096] [--rounds 7] [--peak-tflops 989]
//       [--chunk-mib 256] [--entropy] [--topk K]
//       [--inv-m 1,7,16,300,1024,4133,8141] [--inv-offsets 0,1,17,300]
// Exits 1 with a clear message when no CUDA device is usable, 2 for a bad
// command line. A case whose call fails prints "ERROR: ..." in its row and
// the others go on.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/batch_invariance.h"
#include "bench/bench_args.h"
#include "bench/interleaved_rounds.h"
#include "bench/log_softmax_baseline.h"
#include "bench/synthetic_rows.h"
#include "common/dtype.h"
#include "worker/comm/communicator.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/device_buffers.h"
#include "worker/cuda/device_info.h"
#include "worker/cuda/lm_head_gemm_cublaslt.h"
#include "worker/cuda/row_kernels.h"

namespace logprob::cuda {
namespace {

// Issue 14 targets.
constexpr double kDeviceTarget = 0.90;  // fused from device memory vs GEMM alone
constexpr double kPinnedTarget = 0.85;  // fused from pinned host memory vs GEMM alone
constexpr double kServerFactor = 1.2;   // server worker compute vs the bench's fused time
constexpr double kTokenLogprobsOfCopy = 0.85, kFullOfCopy = 0.70;

struct Config {
  std::string mode = "all";
  int64_t T = 8192, H = 4096;
  std::vector<int64_t> V = {151936, 37984};
  int rounds = 7;
  double peak_tflops = 989;
  size_t chunk_mib = 256;
  kernels::StatsSpec spec;
  std::vector<int64_t> inv_m = {1, 7, 16, 300, 1024, 4133, 8141};
  std::vector<int64_t> inv_offsets = {0, 1, 17, 300};
};

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoll(item));
  return out;
}

std::string Join(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) absl::StrAppend(&s, s.empty() ? "" : ",", x);
  return s;
}

/// A cudaMalloc / cudaMallocHost / malloc allocation freed on scope exit.
struct Mem {
  enum Kind { kDevice, kPinned, kHost } kind;
  void* p = nullptr;
  explicit Mem(Kind k) : kind(k) {}
  Mem(const Mem&) = delete;
  Mem& operator=(const Mem&) = delete;
  ~Mem() {
    if (!p) return;
    if (kind == kDevice) cudaFree(p);
    if (kind == kPinned) cudaFreeHost(p);
    if (kind == kHost) std::free(p);
  }
  absl::Status Alloc(size_t bytes) {
    if (kind == kHost) {
      p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
      return p ? absl::OkStatus() : absl::ResourceExhaustedError(absl::StrCat("malloc of ", bytes, " bytes"));
    }
    const cudaError_t e = kind == kDevice ? cudaMalloc(&p, bytes) : cudaMallocHost(&p, bytes);
    // A failed allocation is not sticky, but it stays the "last error" that
    // the next kernel launcher's cudaGetLastError would report: clear it.
    if (e != cudaSuccess) cudaGetLastError();
    return CudaStatus(e, kind == kDevice ? "cudaMalloc" : "cudaMallocHost");
  }
  template <typename T = char>
  T* get() const {
    return static_cast<T*>(p);
  }
};

std::string Today() {
  char buf[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  return buf;
}

/// "PASS" / "FAIL" against `target` (ratio), "-" without one.
const char* Verdict(double ratio, double target) {
  if (target <= 0) return "-";
  return ratio >= target ? "PASS" : "FAIL";
}

/// Milliseconds of `launch` on the default stream between two events.
absl::Status EventTime(const std::function<absl::Status()>& launch, double* ms) {
  cudaEvent_t a = nullptr, b = nullptr;
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventCreate(&a), "event");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b), "event");
  absl::Status st = CudaStatus(cudaEventRecord(a, nullptr), "event record");
  if (st.ok()) st = launch();
  if (st.ok()) st = CudaStatus(cudaEventRecord(b, nullptr), "event record");
  if (st.ok()) st = CudaStatus(cudaEventSynchronize(b), "kernel");
  float f = 0;
  if (st.ok()) st = CudaStatus(cudaEventElapsedTime(&f, a, b), "elapsed time");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  *ms = f;
  return st;
}

// ---------------------------------------------------------------- logits

void BenchLogits(const Config& cfg, int device, int64_t V) {
  const int64_t T = cfg.T;
  const size_t row_bytes = static_cast<size_t>(V) * 2, bytes = row_bytes * T;
  std::printf(
      "\n== logits: bf16 [%lld, %lld] on the device (%.3f GB), row kernel alone; %d interleaved rounds, "
      "medians, CUDA events\n",
      static_cast<long long>(T), static_cast<long long>(V), bytes / 1e9, cfg.rounds);
  Mem logits(Mem::kDevice), copy(Mem::kDevice), targets(Mem::kDevice), records(Mem::kDevice), sx(Mem::kDevice),
      sid(Mem::kDevice);
  absl::Status st = logits.Alloc(bytes);
  if (st.ok()) st = copy.Alloc(bytes);
  if (st.ok()) st = targets.Alloc(T * 8);
  if (st.ok()) st = records.Alloc(T * record::Words(0, 20) * 4);
  if (st.ok()) st = sx.Alloc(T * 20 * 4);
  if (st.ok()) st = sid.Alloc(T * 20 * 4);
  const int64_t pattern_rows = 64;
  const std::vector<char> pattern = HashBytes(1, pattern_rows * V, 8.f, v1::BF16);
  for (int64_t r = 0; st.ok() && r < T; r += pattern_rows)
    st =
        UploadAndWait(logits.get() + r * row_bytes, pattern.data(), std::min<int64_t>(pattern_rows, T - r) * row_bytes);
  std::vector<int64_t> host_targets(T);
  for (int64_t i = 0; i < T; ++i) host_targets[i] = (i * 7919) % V;
  if (st.ok()) st = UploadAndWait(targets.get(), host_targets.data(), T * 8);
  if (!st.ok()) {
    std::printf("ERROR: setup: %s\n", std::string(st.message()).c_str());
    return;
  }
  const auto rows = [&](bool full) {
    RowBlockArgs a;
    a.logits = logits.get();
    a.type = ElemType::kBF16;
    a.row_stride = a.len = V;
    a.rows = T;
    a.targets = targets.get<int64_t>();
    a.records = records.get<uint32_t>();
    a.entropy = full ? 1 : 0;
    a.topk = full ? 20 : 0;
    a.topk_scratch_x = sx.get<float>();
    a.topk_scratch_id = sid.get<int32_t>();
    return a;
  };
  const auto event_case = [](std::string name, std::function<absl::Status()> launch) {
    BenchCase c;
    c.name = std::move(name);
    c.timer = [launch](double* ms) { return EventTime(launch, ms); };
    return c;
  };
  std::vector<BenchCase> cases;
  cases.push_back(event_case("D2D cudaMemcpyAsync (same bytes)", [&] {
    return CudaStatus(cudaMemcpyAsync(copy.get(), logits.get(), bytes, cudaMemcpyDeviceToDevice, nullptr), "copy");
  }));
  cases.push_back(
      event_case("token logprobs", [&] { return CudaStatus(LaunchRowPartials(rows(false), nullptr), "row kernel"); }));
  cases.push_back(
      event_case("entropy + top-20", [&] { return CudaStatus(LaunchRowPartials(rows(true), nullptr), "row kernel"); }));
  RunInterleaved(cases, cfg.rounds);

  const double peak = PeakMemoryBandwidth(device);
  const double copy_bw = cases[0].ok() ? 2.0 * bytes / (cases[0].median() * 1e-3) : 0;
  if (cases[0].ok())
    std::printf("copy bandwidth: %.3f ms (spread %.1f%%) for %.3f GB = %.1f GB/s (read + written / time)%s\n",
                cases[0].median(), cases[0].spread_percent(), bytes / 1e9, copy_bw / 1e9,
                peak > 0
                    ? absl::StrCat("; peak DRAM ", static_cast<int>(peak / 1e9),
                                   " GB/s (memory clock x bus width), copy = ", static_cast<int>(100 * copy_bw / peak),
                                   "% of it")
                          .c_str()
                    : "");
  else std::printf("copy bandwidth: ERROR: %s (no fractions below)\n", std::string(cases[0].status.message()).c_str());
  std::printf("%-34s %10s %8s %14s %12s %8s %8s\n", "case", "ms", "spread", "GB/s (read)", "of copy bw", "target",
              "verdict");
  for (size_t i = 1; i < cases.size(); ++i) {
    const BenchCase& c = cases[i];
    const double target = i == 1 ? kTokenLogprobsOfCopy : kFullOfCopy;
    if (!c.ok()) {
      std::printf("%-34s ERROR: %s\n", c.name.c_str(), std::string(c.status.message()).c_str());
      continue;
    }
    const double bw = bytes / (c.median() * 1e-3), frac = copy_bw > 0 ? bw / copy_bw : 0;
    std::printf("%-34s %10.3f %7.1f%% %14.1f %11.1f%% %7.0f%% %8s\n", c.name.c_str(), c.median(), c.spread_percent(),
                bw / 1e9, 100 * frac, 100 * target, copy_bw > 0 ? Verdict(frac, target) : "-");
  }
}

// ---------------------------------------------------------------- hidden

/// The rows per chunk the backend's GemmChunkRows gives for `chunk_bytes`
/// (max(16, chunk_bytes / (4 V)), a multiple of 16 below M).
int64_t ChunkRows(size_t chunk_bytes, int64_t V, int64_t M) {
  int64_t g = std::max<int64_t>(16, static_cast<int64_t>(chunk_bytes / (static_cast<size_t>(V) * 4)));
  if (g < M) g -= g % 16;
  return std::min(g, M);
}

/// Token logprobs of `T` records (one slice each).
std::vector<float> TokenLogprobs(const std::vector<uint32_t>& rec, int64_t T, const kernels::StatsSpec& spec) {
  const size_t words = kernels::PartialWords(spec);
  std::vector<float> lp(T);
  std::vector<float> ent(1), tl(std::max(spec.topk, 1)), g(std::max(spec.gather_k, 1));
  std::vector<int64_t> ti(std::max(spec.topk, 1));
  for (int64_t i = 0; i < T; ++i) {
    const uint32_t* p = rec.data() + i * words;
    kernels::CombinePartials(&p, 1, spec, true, {&lp[i], ent.data(), tl.data(), ti.data(), g.data()});
  }
  return lp;
}

/// "max |a - b| = D, within / OUTSIDE docs/SPEC.md's tolerance
/// (2e-4 + 2e-5 |b|) for every row".
std::string Agreement(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  bool within = a.size() == b.size();
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::abs(double(a[i]) - double(b[i]));
    m = std::max(m, d);
    within = within && d <= 2e-4 + 2e-5 * std::abs(double(b[i]));
  }
  return absl::StrCat("max |difference| = ", m, within ? ": every row within" : ": some row OUTSIDE",
                      " SPEC tolerance 2e-4 + 2e-5 |x| (", within ? "OK" : "FAIL", ")");
}

/// Fails with a message (and returns false) when `st` is an error.
bool SetupOk(const absl::Status& st, const char* what) {
  if (st.ok()) return true;
  std::printf("ERROR: %s: %s\n", what, std::string(st.message()).c_str());
  return false;
}

void BenchHidden(const Config& cfg, int device, int64_t V) {
  const int64_t T = cfg.T, H = cfg.H;
  const double flops = 2.0 * T * V * H;
  const int64_t G = ChunkRows(cfg.chunk_mib << 20, V, T);
  const kernels::StatsSpec& spec = cfg.spec;
  const size_t words = kernels::PartialWords(spec), hidden_bytes = static_cast<size_t>(T * H) * 2;
  std::printf(
      "\n== hidden: hidden states bf16 [%lld, %lld] x lm_head bf16 [%lld, %lld] -> f32 logits, %.2f TFLOP per "
      "pass; outputs: token logprobs%s%s; %d interleaved rounds, medians, wall clock of synchronous calls\n",
      static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(V), static_cast<long long>(H),
      flops / 1e12, spec.entropy ? " + entropy" : "", spec.topk ? absl::StrCat(" + top-", spec.topk).c_str() : "",
      cfg.rounds);
  const LmHeadSlice slice = HashLmHead(V, H, 2);
  const std::vector<char> hidden = HashBytes(3, static_cast<size_t>(T * H), 1.f, v1::BF16);
  std::vector<int64_t> targets(T);
  for (int64_t i = 0; i < T; ++i) targets[i] = (i * 7919) % V;
  const BlockRows rows{T, targets.data(), nullptr};

  CudaBackend::Options opts;
  opts.gemm_chunk_bytes = cfg.chunk_mib << 20;
  auto backend_or = CudaBackend::Create(device, opts);
  if (!SetupOk(backend_or.status(), "CudaBackend::Create")) return;
  CudaBackend& backend = **backend_or;
  auto lm_head_or = backend.LoadLmHead(slice, LmHeadPrecision::kAuto);
  if (!SetupOk(lm_head_or.status(), "CudaBackend::LoadLmHead")) return;
  const LmHeadWeights& lm_head = **lm_head_or;
  auto gemm_or = CublasLtLmHead::Create(v1::BF16, slice.weight.data(), slice.weight.size(), V, H);
  if (!SetupOk(gemm_or.status(), "CublasLtLmHead::Create (baseline GEMM)")) return;
  CublasLtLmHead& gemm = **gemm_or;
  const int64_t S = gemm.logits_stride();  // V rounded up to CublasLtLmHead::kLogitsAlign

  Mem d_hidden(Mem::kDevice), pinned(Mem::kPinned), registered(Mem::kHost), chunk_logits(Mem::kDevice),
      full_logits(Mem::kDevice), d_targets(Mem::kDevice), d_logprobs(Mem::kDevice);
  if (!SetupOk(d_hidden.Alloc(hidden_bytes), "hidden states in device memory")) return;
  if (!SetupOk(pinned.Alloc(hidden_bytes), "pinned host memory")) return;
  if (!SetupOk(registered.Alloc(hidden_bytes), "host memory to register")) return;
  if (!SetupOk(chunk_logits.Alloc(static_cast<size_t>(G * S) * 4), "chunk logits")) return;
  const absl::Status full_alloc = full_logits.Alloc(static_cast<size_t>(T * S) * 4);
  if (!SetupOk(d_targets.Alloc(T * 8), "targets") || !SetupOk(d_logprobs.Alloc(T * 4), "logprobs")) return;
  std::memcpy(pinned.get(), hidden.data(), hidden_bytes);
  std::memcpy(registered.get(), hidden.data(), hidden_bytes);
  if (!SetupOk(UploadAndWait(d_hidden.get(), hidden.data(), hidden_bytes), "hidden states upload") ||
      !SetupOk(UploadAndWait(d_targets.get(), targets.data(), T * 8), "targets upload"))
    return;
  backend.RegisterHostMemory(registered.get(), hidden_bytes);
  cudaPointerAttributes attr{};
  const bool page_locked =
      cudaPointerGetAttributes(&attr, registered.get()) == cudaSuccess && attr.type == cudaMemoryTypeHost;
  cudaGetLastError();  // clear a sticky-free error of the query

  SelfCommunicator self;
  const auto item = [&](const void* own, bool on_device) {
    HiddenItemRows it;
    it.dtype = v1::BF16;
    it.own = own;
    it.own_on_device = on_device;
    it.vocab_begin = 0;
    it.first = {0};
    it.count = {T};
    it.rows = rows;
    return it;
  };
  // Records of each fused case, kept for the consistency checks.
  std::vector<std::vector<uint32_t>> rec(5, std::vector<uint32_t>(T * words));
  const auto sync = [] { return CudaStatus(cudaDeviceSynchronize(), "synchronize"); };
  std::vector<BenchCase> cases(8);
  cases[0] = {absl::StrCat("(a) GEMM alone, chunks of ", G, " rows"), [&]() -> absl::Status {
                for (int64_t r0 = 0; r0 < T; r0 += G)
                  LOGPROB_RETURN_IF_ERROR(gemm.Compute(d_hidden.get() + r0 * H * 2, std::min(G, T - r0),
                                                       chunk_logits.get<float>(), nullptr));
                return sync();
              }};
  cases[1] = {"(a1) GEMM alone, one [T, V] GEMM", [&]() -> absl::Status {
                LOGPROB_RETURN_IF_ERROR(full_alloc);
                LOGPROB_RETURN_IF_ERROR(gemm.Compute(d_hidden.get(), T, full_logits.get<float>(), nullptr));
                return sync();
              }};
  cases[2] = {"(b) fused, device memory", [&] {
                return backend.HiddenItemPartials(lm_head, item(d_hidden.get(), true), self, spec, rec[0].data());
              }};
  cases[3] = {"(c) fused, pinned (cudaMallocHost)", [&] {
                return backend.HiddenItemPartials(lm_head, item(pinned.get(), false), self, spec, rec[1].data());
              }};
  cases[4] = {page_locked ? "(c2) fused, RegisterHostMemory'd" : "(c2) fused, RegisterHostMemory'd (NOT locked)", [&] {
                return backend.HiddenItemPartials(lm_head, item(registered.get(), false), self, spec, rec[2].data());
              }};
  cases[5] = {"(d) fused, pageable host", [&] {
                return backend.HiddenItemPartials(lm_head, item(hidden.data(), false), self, spec, rec[3].data());
              }};
  cases[6] = {"(e) HiddenPartials (= one pass), pageable",
              [&] { return backend.HiddenPartials(lm_head, v1::BF16, hidden.data(), 0, rows, spec, rec[4].data()); }};
  cases[7] = {"(f) one GEMM + log_softmax + gather", [&]() -> absl::Status {
                LOGPROB_RETURN_IF_ERROR(full_alloc);
                if (S != V)
                  return absl::InvalidArgumentError(absl::StrCat("the log_softmax baseline needs V a multiple of ",
                                                                 CublasLtLmHead::kLogitsAlign, " (dense logits)"));
                LOGPROB_RETURN_IF_ERROR(gemm.Compute(d_hidden.get(), T, full_logits.get<float>(), nullptr));
                LOGPROB_CUDA_RETURN_IF_ERROR(
                    LaunchLogSoftmaxGather(full_logits.get<float>(), T, V, d_targets.get<int64_t>(),
                                           d_logprobs.get<float>(), nullptr),
                    "log_softmax kernel");
                return sync();
              }};
  RunInterleaved(cases, cfg.rounds);

  const double base = cases[0].ok() ? cases[0].median() : 0, one = cases[1].ok() ? cases[1].median() : 0;
  std::printf("%-46s %10s %8s %9s %9s %9s %7s %8s\n", "case", "ms", "spread", "TFLOP/s", "vs (a)", "vs (a1)", "target",
              "verdict");
  for (size_t i = 0; i < cases.size(); ++i) {
    const BenchCase& c = cases[i];
    if (!c.ok()) {
      std::printf("%-46s ERROR: %s\n", c.name.c_str(), std::string(c.status.message()).c_str());
      continue;
    }
    const double ms = c.median(), ratio = base > 0 ? base / ms : 0;
    const double target = i == 2 ? kDeviceTarget : (i == 3 || i == 4) ? kPinnedTarget : 0;
    std::printf("%-46s %10.3f %7.1f%% %9.1f %9.3f %9.3f %7s %8s\n", c.name.c_str(), ms, c.spread_percent(),
                flops / (ms * 1e-3) / 1e12, ratio, one > 0 ? one / ms : 0.0,
                target > 0 ? absl::StrCat(">=", target).c_str() : "-", base > 0 ? Verdict(ratio, target) : "-");
  }
  std::printf(
      "spread = (max - min) / median of the rounds; ratio = time of (a) / time of the case (1.0 = as fast as the GEMM "
      "alone); TFLOP/s of 2 T V H; "
      "(a) at %.0f%% of --peak-tflops %.0f\n",
      base > 0 ? 100.0 * flops / (base * 1e-3) / 1e12 / cfg.peak_tflops : 0.0, cfg.peak_tflops);
  if (!page_locked)
    std::printf(
        "note: RegisterHostMemory left the malloc'd buffer pageable (the backend does not page-lock yet): "
        "(c2) measured pageable memory\n");
  for (int i : {2, 3})
    if (cases[i].ok())
      std::printf(
          "target for the server (one request of this shape, --backend cuda, 1 worker): "
          "logprob_compute_duration_seconds <= %.1f x %s = %.1f ms\n",
          kServerFactor, cases[i].name.substr(0, 3).c_str(), kServerFactor * cases[i].median());

  // Consistency: the fused paths read the same rows, so their records are
  // bitwise equal; the round path and the materialised baseline agree
  // within float32 rounding.
  std::vector<int> fused_ok;
  for (int i = 0; i < 4; ++i)
    if (cases[2 + i].ok()) fused_ok.push_back(i);
  if (fused_ok.size() >= 2) {
    bool same = true;
    for (int i : fused_ok) same = same && rec[i] == rec[fused_ok[0]];
    std::printf("check: records of the %zu fused cases that ran are %s\n", fused_ok.size(),
                same ? "bitwise identical (OK)" : "NOT identical (FAIL)");
  }
  if (!fused_ok.empty()) {
    const std::vector<float> fused = TokenLogprobs(rec[fused_ok[0]], T, spec);
    if (cases[6].ok())
      std::printf("check: token logprobs of (e) vs fused: %s\n",
                  Agreement(TokenLogprobs(rec[4], T, spec), fused).c_str());
    if (cases[7].ok()) {
      std::vector<float> lsm(T);
      if (cudaMemcpy(lsm.data(), d_logprobs.get(), T * 4, cudaMemcpyDeviceToHost) == cudaSuccess)
        std::printf("check: token logprobs of (f) vs fused: %s\n", Agreement(lsm, fused).c_str());
    }
  }
  backend.UnregisterHostMemory(registered.get());
}

// ---------------------------------------------------------------- invariance

/// True when every check ran and found no mismatch.
bool BenchInvariance(const Config& cfg, int device) {
  const int64_t V = cfg.V.front(), H = cfg.H;
  std::printf(
      "\n== invariance: HiddenItemPartials (W = 1) on lm_head bf16 [%lld, %lld]: 3 probe rows at offsets {%s} "
      "in batches of M in {%s}, entropy + top-20 + 2 gathered ids; records and combined outputs must be "
      "bitwise identical\n",
      static_cast<long long>(V), static_cast<long long>(H), Join(cfg.inv_offsets).c_str(), Join(cfg.inv_m).c_str());
  const LmHeadSlice slice = HashLmHead(V, H, 4);
  auto backend = CudaBackend::Create(device);
  if (!SetupOk(backend.status(), "CudaBackend::Create")) return false;
  auto lm_head = (*backend)->LoadLmHead(slice, LmHeadPrecision::kAuto);
  if (!SetupOk(lm_head.status(), "CudaBackend::LoadLmHead")) return false;
  InvarianceOptions o;
  o.batch_sizes = cfg.inv_m;
  o.offsets = cfg.inv_offsets;
  bool all_ok = true;
  for (bool on_device : {true, false}) {
    const auto r = CheckHiddenItemInvariance(**backend, **lm_head, v1::BF16, on_device, o);
    const char* where = on_device ? "hidden states in device memory" : "hidden states in host memory  ";
    if (!r.ok()) {
      std::printf("%s: ERROR: %s\n", where, std::string(r.status().message()).c_str());
      all_ok = false;
    } else {
      std::printf("%s: %s: %s\n", where, r->ok() ? "PASS" : "FAIL", r->Summary().c_str());
      all_ok = all_ok && r->ok();
    }
  }
  return all_ok;
}

int Usage() {
  std::cerr << "usage: logprob_cuda_bench [--mode logits|hidden|invariance|all] [--t T] [--v V[,V...]] [--h H]\n"
               "    [--rounds R] [--peak-tflops F] [--chunk-mib M] [--entropy] [--topk K]\n"
               "    [--inv-m M[,M...]] [--inv-offsets O[,O...]]"
            << std::endl;
  return 2;
}

int Main(int argc, char** argv) {
  Config cfg;
  try {
    for (BenchArgs args(argc, argv); args.Next();) {
      const std::string a = args.flag();
      if (a == "--mode") cfg.mode = args.Value();
      else if (a == "--t") cfg.T = std::stoll(args.Value());
      else if (a == "--v") cfg.V = ParseList(args.Value());
      else if (a == "--h") cfg.H = std::stoll(args.Value());
      else if (a == "--rounds" || a == "--reps") cfg.rounds = std::stoi(args.Value());
      else if (a == "--peak-tflops") cfg.peak_tflops = std::stod(args.Value());
      else if (a == "--chunk-mib") cfg.chunk_mib = std::stoull(args.Value());
      else if (a == "--entropy") cfg.spec.entropy = true;
      else if (a == "--topk") cfg.spec.topk = std::stoi(args.Value());
      else if (a == "--inv-m") cfg.inv_m = ParseList(args.Value());
      else if (a == "--inv-offsets") cfg.inv_offsets = ParseList(args.Value());
      else return Usage();
    }
  } catch (const std::exception& e) {
    std::cerr << "bad number: " << e.what() << std::endl;
    return Usage();
  }
  const bool known = cfg.mode == "logits" || cfg.mode == "hidden" || cfg.mode == "invariance" || cfg.mode == "all";
  if (!known || cfg.V.empty() || cfg.T <= 0 || cfg.H <= 0 || cfg.rounds <= 0 || cfg.spec.topk < 0 ||
      std::any_of(cfg.V.begin(), cfg.V.end(), [](int64_t v) { return v <= 0; }))
    return Usage();
  auto device = SelectDevice(0, 0);
  if (!device.ok()) {
    std::cerr << "logprob_cuda_bench: " << device.status().message() << " (this benchmark needs a GPU)" << std::endl;
    return 1;
  }
  std::printf("logprob_cuda_bench --mode %s: %s, %s\n", cfg.mode.c_str(), DeviceDescription(*device).c_str(),
              Today().c_str());
  std::printf(
      "issue 14 targets: fused hidden path >= %.2f x the rate of the cuBLASLt GEMM alone from device memory, "
      ">= %.2f from pinned host memory; server worker compute <= %.1f x the fused time; logits row kernel "
      ">= %.0f%% of the D2D copy bandwidth for token logprobs, >= %.0f%% with entropy + top-20; for every V\n",
      kDeviceTarget, kPinnedTarget, kServerFactor, 100 * kTokenLogprobsOfCopy, 100 * kFullOfCopy);
  std::fflush(stdout);
  const bool all = cfg.mode == "all";
  if (all || cfg.mode == "logits")
    for (int64_t V : cfg.V) {
      BenchLogits(cfg, *device, V);
      std::fflush(stdout);
    }
  if (all || cfg.mode == "hidden")
    for (int64_t V : cfg.V) {
      BenchHidden(cfg, *device, V);
      std::fflush(stdout);
    }
  if (all || cfg.mode == "invariance") {
    if (!BenchInvariance(cfg, *device)) {
      std::printf("invariance: FAILED (exit status 1)\n");
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace logprob::cuda

int main(int argc, char** argv) { return logprob::cuda::Main(argc, argv); }
