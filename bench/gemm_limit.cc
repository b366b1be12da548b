#include "bench/gemm_limit.h"

#include <omp.h>

#include <fstream>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace logprob::bench {

std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  return "unknown";
}

struct ReferenceSgemm::Data {
  int64_t M, N, K;
  int threads;
  std::vector<float> a, b, c;
};

ReferenceSgemm::ReferenceSgemm(int64_t M, int64_t N, int64_t K, int threads)
    : d_(std::make_unique<Data>(Data{M, N, K, threads, {}, {}, {}})) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  d_->a.resize(static_cast<size_t>(M * K));
  d_->b.resize(static_cast<size_t>(N * K));
  d_->c.resize(static_cast<size_t>(M * N));
  for (float& x : d_->a) x = dist(rng);
  for (float& x : d_->b) x = 0.02f * dist(rng);
}

ReferenceSgemm::~ReferenceSgemm() = default;

absl::Status ReferenceSgemm::Run() {
  if (d_->threads > 0) omp_set_num_threads(d_->threads);
  // Row-major C = A B^T: oneDNN's sgemm is row-major like cblas_sgemm.
  const dnnl::status st = dnnl::sgemm('N', 'T', d_->M, d_->N, d_->K, 1.f, d_->a.data(), d_->K, d_->b.data(), d_->K, 0.f,
                                      d_->c.data(), d_->N);
  if (st != dnnl::status::success)
    return absl::InternalError(absl::StrCat("dnnl_sgemm failed: ", static_cast<int>(st)));
  return absl::OkStatus();
}

double ReferenceSgemm::flops() const {
  return 2.0 * static_cast<double>(d_->M) * static_cast<double>(d_->N) * static_cast<double>(d_->K);
}

}  // namespace logprob::bench
