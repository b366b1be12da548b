#include "worker/cuda/lm_head_gemm_cublaslt.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

absl::Status LtStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("cuBLASLt ", what, ": ", cublasLtGetStatusName(s), " (", cublasLtGetStatusString(s), ")"));
}
#define LOGPROB_LT_RETURN_IF_ERROR(call, what) LOGPROB_RETURN_IF_ERROR(LtStatus((call), what))

}  // namespace

/// Column-major view: D[N, M] = op(A)[N, H] x B[H, M] with A the weight
/// stored [H, N] (ld H, transposed), B the hidden states [H, M] (ld H) and
/// D the logits [N, M] (ld N), i.e. row-major logits[M, N].
struct CublasLtLmHead::Plan {
  cublasLtMatrixLayout_t b = nullptr, d = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic{};
  ~Plan() {
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
  }
};

CublasLtLmHead::~CublasLtLmHead() {
  plans_.clear();
  if (a_layout_) cublasLtMatrixLayoutDestroy(a_layout_);
  if (op_) cublasLtMatmulDescDestroy(op_);
  if (handle_) cublasLtDestroy(handle_);
}

absl::StatusOr<std::unique_ptr<CublasLtLmHead>> CublasLtLmHead::Create(DType dtype, const void* weight,
                                                                       size_t weight_bytes, int64_t rows,
                                                                       int64_t hidden_size) {
  LOGPROB_RETURN_IF_ERROR(kernels::CheckLmHeadWeight(dtype, weight_bytes, rows, hidden_size));
  std::unique_ptr<CublasLtLmHead> g(new CublasLtLmHead());
  g->rows_ = rows;
  g->hidden_size_ = hidden_size;
  const size_t n = static_cast<size_t>(rows * hidden_size);
  if (dtype == v1::F16) {  // widen once, as the CPU GEMM does
    std::vector<float> wide(n);
    ToFloat(dtype, weight, n, wide.data());
    g->compute_dtype_ = v1::F32;
    LOGPROB_RETURN_IF_ERROR(g->weight_.Reserve(n * 4));
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpy(g->weight_.get(), wide.data(), n * 4, cudaMemcpyHostToDevice),
                                 "lm_head upload");
  } else {
    g->compute_dtype_ = dtype;
    LOGPROB_RETURN_IF_ERROR(g->weight_.Reserve(weight_bytes));
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpy(g->weight_.get(), weight, weight_bytes, cudaMemcpyHostToDevice),
                                 "lm_head upload");
  }
  LOGPROB_RETURN_IF_ERROR(g->workspace_.Reserve(kWorkspaceBytes));
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtCreate(&g->handle_), "create");
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&g->op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
                             "transa");
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
                             "transb");
  const cudaDataType_t ab = g->compute_dtype_ == v1::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&g->a_layout_, ab, static_cast<uint64_t>(hidden_size),
                                                        static_cast<uint64_t>(rows), hidden_size),
                             "weight layout");
  return g;
}

absl::Status CublasLtLmHead::Compute(const void* hidden, int64_t M, float* logits, cudaStream_t stream) {
  if (M < 0) return absl::InvalidArgumentError(absl::StrCat("negative row count ", M));
  if (M == 0) return absl::OkStatus();
  auto it = plans_.find(M);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    const cudaDataType_t ab = compute_dtype_ == v1::BF16 ? CUDA_R_16BF : CUDA_R_32F;
    LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, ab, static_cast<uint64_t>(hidden_size_),
                                                          static_cast<uint64_t>(M), hidden_size_),
                               "hidden layout");
    LOGPROB_LT_RETURN_IF_ERROR(
        cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_32F, static_cast<uint64_t>(rows_), static_cast<uint64_t>(M), rows_),
        "logits layout");
    cublasLtMatmulPreference_t pref = nullptr;
    LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&pref), "preference");
    const size_t ws = workspace_.size();
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    // Callers pass chunks of the hidden states starting at multiples of 16
    // rows: their alignment is that of 16 * H elements (at most 256 bytes).
    const uint64_t row16 = 16 * static_cast<uint64_t>(hidden_size_) * DTypeSize(compute_dtype_);
    const uint32_t b_align = static_cast<uint32_t>(std::min<uint64_t>(256, row16 & (~row16 + 1)));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b_align, sizeof b_align);
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle_, op_, a_layout_, plan->b, plan->d, plan->d, pref, 1,
                                                            &plan->heuristic, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    LOGPROB_LT_RETURN_IF_ERROR(s, "heuristic");
    if (found == 0)
      return absl::InternalError(absl::StrCat("cuBLASLt has no algorithm for [", M, ", ", hidden_size_, "] x [",
                                              hidden_size_, ", ", rows_, "]"));
    it = plans_.emplace(M, std::move(plan)).first;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const Plan& p = *it->second;
  return LtStatus(cublasLtMatmul(handle_, op_, &alpha, weight_.get(), a_layout_, hidden, p.b, &beta, logits, p.d,
                                 logits, p.d, &p.heuristic.algo, workspace_.get(), workspace_.size(), stream),
                  "matmul");
}

}  // namespace logprob::cuda
