#include "worker/cuda/lt_f32_matmul.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_error.h"
#include "worker/cuda/lt_algo.h"

namespace logprob::cuda {

struct LtF32Matmul::Plan {
  cublasLtMatrixLayout_t b = nullptr, d = nullptr;
  ~Plan() {
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

LtF32Matmul::~LtF32Matmul() {
  plans_.clear();
  if (a_) cublasLtMatrixLayoutDestroy(a_);
  if (op_) cublasLtMatmulDescDestroy(op_);
}

absl::Status LtF32Matmul::MakeLayouts(int64_t n, Plan* plan) const {
  const Shape& s = shape_;
  const uint64_t rows_b = static_cast<uint64_t>(s.trans_b ? n : s.k),
                 cols_b = static_cast<uint64_t>(s.trans_b ? s.k : n);
  LOGPROB_RETURN_IF_ERROR(
      LtStatus(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_32F, rows_b, cols_b, s.ldb), "matmul B layout"));
  return LtStatus(
      cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_32F, static_cast<uint64_t>(s.m), static_cast<uint64_t>(n), s.ldd),
      "matmul D layout");
}

absl::StatusOr<std::unique_ptr<LtF32Matmul>> LtF32Matmul::Create(cublasLtHandle_t handle, const Shape& s,
                                                                 size_t max_workspace, std::string name,
                                                                 bool log_choice) {
  const int64_t rows_a = s.trans_a ? s.k : s.m, rows_b = s.trans_b ? s.ref_n : s.k;
  if (handle == nullptr || s.m <= 0 || s.k <= 0 || s.ref_n <= 0 || s.lda < rows_a || s.ldb < rows_b || s.ldd < s.m)
    return absl::InvalidArgumentError(absl::StrCat(name, ": bad matmul shape m ", s.m, ", k ", s.k, ", n ", s.ref_n,
                                                   ", lda ", s.lda, ", ldb ", s.ldb, ", ldd ", s.ldd));
  std::unique_ptr<LtF32Matmul> g(new LtF32Matmul());
  g->handle_ = handle;
  g->shape_ = s;
  g->max_workspace_ = max_workspace;
  g->name_ = std::move(name);
  LOGPROB_RETURN_IF_ERROR(LtStatus(cublasLtMatmulDescCreate(&g->op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc"));
  const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOGPROB_RETURN_IF_ERROR(
      LtStatus(cublasLtMatmulDescSetAttribute(g->op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "transa"));
  LOGPROB_RETURN_IF_ERROR(
      LtStatus(cublasLtMatmulDescSetAttribute(g->op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "transb"));
  LOGPROB_RETURN_IF_ERROR(LtStatus(cublasLtMatrixLayoutCreate(&g->a_, CUDA_R_32F, static_cast<uint64_t>(rows_a),
                                                              static_cast<uint64_t>(s.trans_a ? s.m : s.k), s.lda),
                                   "matmul A layout"));
  Plan ref;
  LOGPROB_RETURN_IF_ERROR(g->MakeLayouts(s.ref_n, &ref));
  absl::StatusOr<UnsplitAlgo> chosen = ChooseUnsplitAlgo(handle, g->op_, g->a_, ref.b, ref.d, max_workspace, s.b_align);
  if (!chosen.ok())
    return absl::Status(
        absl::IsNotFound(chosen.status()) ? absl::StatusCode::kInternal : chosen.status().code(),
        absl::StrCat(g->name_, " [", s.m, ", ", s.k, "] x [", s.k, ", ", s.ref_n, "]: ", chosen.status().message()));
  g->algo_ = chosen->algo;
  g->algo_summary_ = chosen->summary;
  if (log_choice)
    std::fprintf(stderr,
                 "logprob-worker: %s f32 [%lld, %lld] x [%lld, n] (algorithm chosen at n = %lld): cuBLASLt %s%s\n",
                 g->name_.c_str(), static_cast<long long>(s.m), static_cast<long long>(s.k),
                 static_cast<long long>(s.k), static_cast<long long>(s.ref_n), chosen->summary.c_str(),
                 chosen->forced_from.empty() ? "" : " (split forced off)");
  return g;
}

absl::Status LtF32Matmul::Run(const float* a, const float* b, float* d, int64_t n, float beta, void* workspace,
                              cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat(name_, ": negative column count ", n));
  if (n == 0) return absl::OkStatus();
  auto it = plans_.find(n);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    LOGPROB_RETURN_IF_ERROR(MakeLayouts(n, plan.get()));
    // The one algorithm (batch invariance): never a per-n heuristic choice.
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t st = cublasLtMatmulAlgoCheck(handle_, op_, a_, plan->b, plan->d, plan->d, &algo_, &check);
    if (st != CUBLAS_STATUS_SUCCESS || check.workspaceSize > max_workspace_)
      return absl::InternalError(
          absl::StrCat(name_, ": the algorithm chosen at n = ", shape_.ref_n, " does not run n = ", n, ": ",
                       st != CUBLAS_STATUS_SUCCESS ? std::string(cublasLtGetStatusString(st))
                                                   : absl::StrCat("needs ", check.workspaceSize, " workspace bytes")));
    it = plans_.emplace(n, std::move(plan)).first;
  }
  const float alpha = 1.0f;
  const Plan& p = *it->second;
  CudaRuntimeErrors::GetLastError();  // an earlier call's error is not this matmul's
  return LtStatus(cublasLtMatmul(handle_, op_, &alpha, a, a_, b, p.b, &beta, d, p.d, d, p.d, &algo_, workspace,
                                 max_workspace_, stream),
                  name_.c_str(), stream);
}

}  // namespace logprob::cuda
