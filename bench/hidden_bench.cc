// logprob_hidden_bench: the hidden-states path of one worker (lm_head
// slice of N vocabulary rows, H = 4096, bf16) against plain oneDNN GEMMs.
//
// For each (N, T) it runs three modes, each in its own child process so
// that peak RSS (ru_maxrss) is the mode's own:
//   gemm       one oneDNN matmul [T, H] x [H, N] -> f32 logits, nothing else;
//   fused      ScoreWorkItem on a HIDDEN_STATES item (the worker's code
//              path, SelfCommunicator): chunked GEMM feeding the one-pass
//              statistics, token logprobs (+ entropy and top-20 with --full);
//   full+lsm   the GEMM to full [T, N] logits, then a float32 log_softmax of
//              every row and a gather of the target (what trainers do).
//   sgemm      the box's limit: oneDNN's own fp32 GEMM (dnnl_sgemm) of the
//              same shape in one call, on the same threads (bench/gemm_limit.h).
// It prints the CPU's model and the ISA oneDNN runs at (ONEDNN_MAX_CPU_ISA
// emulates an older CPU), then a table: median seconds, tokens/s, GEMM
// GFLOP/s (2*T*N*H / s), time relative to `gemm`, the fraction of the
// box's limit (sgemm's time / the mode's), and peak RSS.
//
//   logprob_hidden_bench [--h 4096] [--n 32000,18992] [--t 512,2048,8192]
//                        [--reps 3] [--chunk 128] [--full] [--threads 0]
//                        [--backend cpu|cuda]
// With --backend cuda the lm_head lives on GPU 0: `fused` is the worker's
// GPU path (hidden states uploaded, chunked cuBLASLt GEMM + row kernel,
// records back); `gemm` and `full+lsm` include downloading the [T, N]
// logits to the host (device-only numbers: logprob_cuda_bench).
//
//   logprob_hidden_bench --precisions bf16,tf32,fp32 [--rounds 7] [--h 2048]
//                        [--n 32000] [--t 256] ...
// instead times the `fused` path under each --lm-head-precision (first N
// and T), one backend per precision in this process, with bf16 and with
// f32 hidden states: rounds interleave the precisions; it prints median
// seconds, the median over rounds of each one's time divided by the
// first precision's time in the same round, and of sgemm's time (the box's
// limit, interleaved with them) divided by its time. `--cpu-kernels
// bf16,widen` times the bf16 precision once per CPU kernel
// (--lm-head-cpu-kernel; rows "bf16/bf16", "bf16/widen"); without
// --precisions the modes run the first kernel listed.
#include <omp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_args.h"
#include "bench/gemm_limit.h"
#include "bench/interleaved_rounds.h"
#include "common/dtype.h"
#include "common/lm_head_cpu_kernel.h"
#include "common/lm_head_precision.h"
#include "worker/backend_factory.h"
#include "worker/comm/communicator.h"
#include "worker/kernels/lm_head_kernel_choice.h"
#include "worker/scoring/scorer.h"

namespace logprob {
namespace {

struct Config {
  int64_t H = 4096;
  std::vector<int64_t> N = {32000, 18992};
  std::vector<int64_t> T = {512, 2048, 8192};
  int reps = 3;
  int64_t chunk = 128;
  bool full = false;
  int threads = 0;
  std::string backend = "cpu";
  std::vector<LmHeadPrecision> precisions;                              // non-empty: compare them (PrecisionMain)
  std::vector<LmHeadCpuKernel> cpu_kernels = {LmHeadCpuKernel::kAuto};  // the bf16 precision's, each timed
  int rounds = 7;
};

/// The comma-separated items of `s`.
std::vector<std::string> ParseNames(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  for (const std::string& item : ParseNames(s)) out.push_back(std::stoll(item));
  return out;
}

/// Random bf16 values, normal(0, sd).
std::vector<char> RandomBf16(size_t n, float sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, sd);
  std::vector<char> out(n * 2);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t b = FloatToBf16(dist(rng));
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// A HIDDEN_STATES work item of T rows of `hidden` ([T, H] of `dtype`)
/// over one worker's whole slice [0, N), with `targets`.
internal::v1::WorkItem HiddenItem(const Config& cfg, int64_t N, int64_t T, DType dtype, const std::vector<char>& hidden,
                                  const std::vector<int64_t>& targets) {
  internal::v1::WorkItem item;
  item.set_layout(internal::v1::HIDDEN_STATES);
  item.set_num_rows(T);
  item.set_vocab_size(N);
  item.set_vocab_begin(0);
  item.set_vocab_end(N);
  item.set_dtype(dtype);
  item.set_hidden_size(cfg.H);
  item.set_data(hidden.data(), hidden.size());
  item.mutable_targets()->Add(targets.begin(), targets.end());
  if (cfg.full) {
    item.mutable_options()->set_entropy(true);
    item.mutable_options()->set_topk(20);
  }
  return item;
}

/// Runs one mode `reps` times (after one untimed run) and returns the
/// median seconds, or a negative value on failure.
double RunMode(const std::string& mode, const Config& cfg, int64_t N, int64_t T) {
  if (mode == "sgemm") {
    bench::ReferenceSgemm sgemm(T, N, cfg.H, cfg.threads);
    if (!sgemm.Run().ok()) return -1;
    std::vector<double> times;
    for (int i = 0; i < cfg.reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!sgemm.Run().ok()) return -1;
      times.push_back(Seconds(t0));
    }
    return Median(times);
  }
  LmHeadSlice slice{v1::BF16, RandomBf16(static_cast<size_t>(N * cfg.H), 0.02f, 1), N, cfg.H};
  BackendConfig backend_config;
  backend_config.backend = cfg.backend;
  backend_config.threads = cfg.threads;
  backend_config.lm_head_cpu_kernel = cfg.cpu_kernels.front();  // the modes time one kernel: the first
  auto made = MakeBackend(backend_config);
  if (!made.ok()) {
    std::cerr << made.status() << std::endl;
    return -1;
  }
  ScoringBackend& backend = **made;
  auto lm_head = backend.LoadLmHead(std::move(slice), LmHeadPrecision::kAuto);
  if (!lm_head.ok()) {
    std::cerr << lm_head.status() << std::endl;
    return -1;
  }
  const std::vector<char> hidden = RandomBf16(static_cast<size_t>(T * cfg.H), 1.f, 2);
  std::vector<int64_t> targets(T);
  for (int64_t i = 0; i < T; ++i) targets[i] = (i * 7919) % N;
  std::vector<float> logits;
  internal::v1::WorkItem item;
  if (mode == "fused") {
    item = HiddenItem(cfg, N, T, v1::BF16, hidden, targets);
  } else {
    logits.resize(static_cast<size_t>(T * N));
  }
  SelfCommunicator self;
  std::vector<float> lp(T);
  auto once = [&]() -> bool {
    if (mode == "fused") {
      auto res = ScoreWorkItem(item, self, backend, cfg.chunk, {}, lm_head->get());
      if (!res.ok()) std::cerr << res.status() << std::endl;
      return res.ok();
    }
    if (!backend.HiddenLogits(**lm_head, v1::BF16, hidden.data(), T, logits.data()).ok()) return false;
    if (mode == "full+lsm") {
      for (int64_t r = 0; r < T; ++r) {
        float* row = logits.data() + r * N;
        const float m = *std::max_element(row, row + N);
        double s = 0;
        for (int64_t v = 0; v < N; ++v) s += std::exp(row[v] - m);
        const float lse = m + static_cast<float>(std::log(s));
        for (int64_t v = 0; v < N; ++v) row[v] -= lse;
        lp[r] = row[targets[r]];
      }
    }
    return true;
  };
  if (!once()) return -1;
  std::vector<double> times;
  for (int i = 0; i < cfg.reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!once()) return -1;
    times.push_back(Seconds(t0));
  }
  return Median(times);
}

struct Measured {
  double seconds = -1;
  long peak_rss_kib = 0;
};

/// RunMode in a child process; its median seconds come back through a pipe.
Measured InChild(const std::string& mode, const Config& cfg, int64_t N, int64_t T) {
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const double s = RunMode(mode, cfg, N, T);
    (void)!write(fds[1], &s, sizeof s);
    _exit(s < 0 ? 1 : 0);
  }
  close(fds[1]);
  Measured m;
  if (read(fds[0], &m.seconds, sizeof m.seconds) != sizeof m.seconds) m.seconds = -1;
  close(fds[0]);
  int status = 0;
  rusage ru{};
  wait4(pid, &status, 0, &ru);
  m.peak_rss_kib = ru.ru_maxrss;
  return m;
}

/// --precisions: the fused path of one [T, H] x [H, N] item under each
/// precision, `rounds` interleaved rounds after a warm-up; medians and
/// per-round ratios to cfg.precisions[0], for bf16 and f32 hidden states.
int PrecisionMain(const Config& cfg) {
  const int64_t N = cfg.N.front(), T = cfg.T.front();
  // One backend and head per precision, and per CPU kernel for bf16.
  struct Variant {
    std::string name;
    std::unique_ptr<ScoringBackend> backend;
    std::shared_ptr<const LmHeadWeights> head;
  };
  std::vector<Variant> variants;
  for (LmHeadPrecision p : cfg.precisions) {
    const bool per_kernel = p == LmHeadPrecision::kBf16 && cfg.backend == "cpu";
    for (LmHeadCpuKernel k : per_kernel ? cfg.cpu_kernels : std::vector<LmHeadCpuKernel>{LmHeadCpuKernel::kAuto}) {
      BackendConfig bc;
      bc.backend = cfg.backend;
      bc.threads = cfg.threads;
      bc.lm_head_cpu_kernel = k;
      auto made = MakeBackend(bc);
      if (!made.ok()) {
        std::cerr << made.status() << std::endl;
        return 1;
      }
      Variant v{LmHeadPrecisionName(p), *std::move(made), nullptr};
      if (per_kernel && cfg.cpu_kernels.size() > 1) v.name = absl::StrCat(v.name, "/", LmHeadCpuKernelName(k));
      LmHeadSlice slice{v1::BF16, RandomBf16(static_cast<size_t>(N * cfg.H), 0.02f, 1), N, cfg.H};
      auto loaded = v.backend->LoadLmHead(std::move(slice), p);
      if (!loaded.ok()) {
        std::cerr << v.name << ": " << loaded.status() << std::endl;
        return 1;
      }
      v.head = *std::move(loaded);
      variants.push_back(std::move(v));
    }
  }
  std::vector<int64_t> targets(T);
  for (int64_t i = 0; i < T; ++i) targets[i] = (i * 7919) % N;
  std::printf("backend %s, BF16 lm_head [%lld, %lld], T=%lld, chunk=%lld, %s, median of %d interleaved rounds\n",
              cfg.backend.c_str(), static_cast<long long>(N), static_cast<long long>(cfg.H), static_cast<long long>(T),
              static_cast<long long>(cfg.chunk), cfg.full ? "token logprobs + entropy + top-20" : "token logprobs",
              cfg.rounds);
  std::printf("CPU %s, oneDNN ISA %s, %d threads\n", bench::CpuModelName().c_str(), kernels::EffectiveCpuIsa().c_str(),
              cfg.threads > 0 ? cfg.threads : omp_get_max_threads());
  std::printf("%-7s %-12s %9s %8s %9s %8s\n", "hidden", "precision", "seconds", "GFLOP/s", "vs first", "of best");
  bench::ReferenceSgemm sgemm(T, N, cfg.H, cfg.threads);
  SelfCommunicator self;
  for (DType hdt : {v1::BF16, v1::F32}) {
    std::vector<char> hidden = RandomBf16(static_cast<size_t>(T * cfg.H), 1.f, 2);
    if (hdt == v1::F32) {  // full 24-bit significands: every precision's rounding applies
      std::mt19937 rng(3);
      std::normal_distribution<float> dist(0.f, 1.f);
      hidden.resize(static_cast<size_t>(T * cfg.H) * 4);
      for (size_t i = 0; i < static_cast<size_t>(T * cfg.H); ++i) {
        const float f = dist(rng);
        std::memcpy(hidden.data() + 4 * i, &f, 4);
      }
    }
    const internal::v1::WorkItem item = HiddenItem(cfg, N, T, hdt, hidden, targets);
    std::vector<BenchCase> cases;
    for (Variant& v : variants)
      cases.push_back(
          {v.name, [&] { return ScoreWorkItem(item, self, *v.backend, cfg.chunk, {}, v.head.get()).status(); }});
    cases.push_back({"sgemm fp32", [&] { return sgemm.Run(); }});  // the box's limit, interleaved
    RunInterleaved(cases, cfg.rounds);
    const BenchCase& best = cases.back();
    for (const BenchCase& c : cases)
      if (!c.status.ok()) {
        std::cerr << c.name << ": " << c.status << std::endl;
        return 1;
      }
    for (const BenchCase& c : cases) {
      // The ratio to the first precision within each round, then its median:
      // robust to load that drifts between rounds.
      std::vector<double> ratios, of_best;
      for (size_t r = 0; r < c.ms.size(); ++r) {
        ratios.push_back(c.ms[r] / cases[0].ms[r]);
        of_best.push_back(best.ms[r] / c.ms[r]);
      }
      const double med = c.median() * 1e-3;
      std::printf("%-7s %-12s %9.4f %8.1f %9.3f %8.2f\n", DTypeName(hdt), c.name.c_str(), med,
                  sgemm.flops() / med * 1e-9, Median(ratios), Median(of_best));
      std::fflush(stdout);
    }
  }
  return 0;
}

int Main(int argc, char** argv) {
  Config cfg;
  for (BenchArgs args(argc, argv); args.Next();) {
    const std::string a = args.flag();
    auto next = [&] { return args.Value(); };
    if (a == "--h") cfg.H = std::stoll(next());
    else if (a == "--n") cfg.N = ParseList(next());
    else if (a == "--t") cfg.T = ParseList(next());
    else if (a == "--reps") cfg.reps = std::stoi(next());
    else if (a == "--chunk") cfg.chunk = std::stoll(next());
    else if (a == "--threads") cfg.threads = std::stoi(next());
    else if (a == "--full") cfg.full = true;
    else if (a == "--backend") cfg.backend = next();
    else if (a == "--rounds") cfg.rounds = std::stoi(next());
    else if (a == "--precisions") {
      for (const std::string& name : ParseNames(next())) {
        auto p = ParseLmHeadPrecision(name, "--precisions");
        if (!p.ok()) {
          std::cerr << p.status().message() << std::endl;
          return 2;
        }
        cfg.precisions.push_back(*p);
      }
    } else if (a == "--cpu-kernels") {
      cfg.cpu_kernels.clear();
      for (const std::string& name : ParseNames(next())) {
        auto k = ParseLmHeadCpuKernel(name, "--cpu-kernels");
        if (!k.ok()) {
          std::cerr << k.status().message() << std::endl;
          return 2;
        }
        cfg.cpu_kernels.push_back(*k);
      }
      if (cfg.cpu_kernels.empty()) {
        std::cerr << "--cpu-kernels: name at least one of auto, bf16, widen" << std::endl;
        return 2;
      }
    } else {
      std::cerr << "usage: logprob_hidden_bench [--h H] [--n N1,N2] [--t T1,T2] [--reps R] [--chunk C] [--full] "
                   "[--threads K] [--backend cpu|cuda] [--precisions bf16,tf32,fp32 [--rounds R] "
                   "[--cpu-kernels bf16,widen]]"
                << std::endl;
      return 2;
    }
  }
  if (!cfg.precisions.empty()) return cfg.rounds > 0 ? PrecisionMain(cfg) : 2;
  std::printf("backend %s, H=%lld bf16, chunk=%lld tokens, %s, median of %d\n", cfg.backend.c_str(),
              static_cast<long long>(cfg.H), static_cast<long long>(cfg.chunk),
              cfg.full ? "token logprobs + entropy + top-20" : "token logprobs", cfg.reps);
  std::printf("CPU %s, oneDNN ISA %s, %d threads, bf16 CPU kernel %s\n", bench::CpuModelName().c_str(),
              kernels::EffectiveCpuIsa().c_str(), cfg.threads > 0 ? cfg.threads : omp_get_max_threads(),
              LmHeadCpuKernelName(cfg.cpu_kernels.front()));
  std::printf("%7s %6s %-9s %9s %11s %8s %8s %8s %9s\n", "N", "T", "mode", "seconds", "tokens/s", "GFLOP/s", "vs gemm",
              "of best", "peak MiB");
  for (int64_t N : cfg.N) {
    for (int64_t T : cfg.T) {
      const std::vector<std::string> modes = {"gemm", "sgemm", "fused", "full+lsm"};
      std::vector<Measured> measured;
      for (const std::string& mode : modes) {
        std::fprintf(stderr, "running N=%lld T=%lld %s ...\n", static_cast<long long>(N), static_cast<long long>(T),
                     mode.c_str());
        measured.push_back(InChild(mode, cfg, N, T));
      }
      const double gemm_s = measured[0].seconds, best_s = measured[1].seconds;
      for (size_t i = 0; i < modes.size(); ++i) {
        const Measured& m = measured[i];
        if (m.seconds < 0) {
          std::printf("%7lld %6lld %-9s failed\n", static_cast<long long>(N), static_cast<long long>(T),
                      modes[i].c_str());
          continue;
        }
        const double flops = 2.0 * static_cast<double>(T) * static_cast<double>(N) * static_cast<double>(cfg.H);
        std::printf("%7lld %6lld %-9s %9.4f %11.0f %8.1f %8.3f %8.2f %9.0f\n", static_cast<long long>(N),
                    static_cast<long long>(T), modes[i].c_str(), m.seconds, static_cast<double>(T) / m.seconds,
                    flops / m.seconds * 1e-9, gemm_s > 0 ? m.seconds / gemm_s : 0.0,
                    best_s > 0 ? best_s / m.seconds : 0.0, m.peak_rss_kib / 1024.0);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace logprob

int main(int argc, char** argv) { return logprob::Main(argc, argv); }
