#include "worker/cuda/lm_head_gemm_cublaslt.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/converting_upload.h"
#include "worker/cuda/elem_type.h"
#include "worker/cuda/lm_head_transform.h"
#include "worker/cuda/lt_algo.h"
#include "worker/kernels/lm_head_gemm.h"

namespace logprob::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

#define LOGPROB_LT_RETURN_IF_ERROR(call, what) LOGPROB_RETURN_IF_ERROR(LtStatus((call), what))

}  // namespace

/// Column-major view: D[S, M] = op(A)[S, H] x B[H, M] with A the weight
/// stored [H, S] (ld H, transposed), B the hidden states [H, M] (ld H) and
/// D the logits [S, M] (ld S), i.e. row-major logits[M, S], S = stride_.
struct CublasLtLmHead::Plan {
  cublasLtMatrixLayout_t b = nullptr, d = nullptr;
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

absl::Status CublasLtLmHead::MakeLayouts(int64_t m, Plan* plan) const {
  const cudaDataType_t ab = compute_dtype_ == v1::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->b, ab, static_cast<uint64_t>(hidden_size_),
                                                        static_cast<uint64_t>(m), hidden_size_),
                             "hidden layout");
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_32F, static_cast<uint64_t>(stride_),
                                                        static_cast<uint64_t>(m), stride_),
                             "logits layout");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CublasLtLmHead>> CublasLtLmHead::Create(DType dtype, const void* weight,
                                                                       size_t weight_bytes, int64_t rows,
                                                                       int64_t hidden_size, LmHeadPrecision precision,
                                                                       int64_t algo_rows, DeviceRecycler* recycler,
                                                                       DeviceRecycler* staging_recycler) {
  LOGPROB_RETURN_IF_ERROR(kernels::CheckLmHeadWeight(dtype, weight_bytes, rows, hidden_size));
  if (algo_rows <= 0) return absl::InvalidArgumentError(absl::StrCat("algo_rows must be > 0, got ", algo_rows));
  std::unique_ptr<CublasLtLmHead> g(new CublasLtLmHead());
  g->rows_ = rows;
  g->stride_ = (rows + kLogitsAlign - 1) / kLogitsAlign * kLogitsAlign;
  g->hidden_size_ = hidden_size;
  g->precision_ = ResolveLmHeadPrecision(precision, dtype);
  g->algo_rows_ = algo_rows;
  const int64_t n = rows * hidden_size;
  const bool bf16 = g->precision_ == LmHeadPrecision::kBf16;
  g->compute_dtype_ = bf16 ? v1::BF16 : v1::F32;
  const size_t esize = DTypeSize(g->compute_dtype_);
  g->weight_bytes_ = static_cast<size_t>(g->stride_ * hidden_size) * esize;
  DeviceRecycler own(/*max_idle=*/0);  // without a recycler: freed when let go
  LOGPROB_ASSIGN_OR_RETURN(g->weight_, (recycler != nullptr ? *recycler : own).Take(g->weight_bytes_));
  // The padding rows are zero (a recycled buffer holds an old version's).
  const size_t used = static_cast<size_t>(n) * esize;
  if (g->weight_bytes_ > used)
    LOGPROB_RETURN_IF_ERROR(ZeroAndWait(static_cast<char*>(g->weight_.get()) + used, g->weight_bytes_ - used));
  // Converted on the device (bf16 round to nearest even, f32 exact: the
  // CPU GEMM's operands), through a staging buffer that is recycled too:
  // an update touches no fresh host memory and mallocs nothing on the device.
  const size_t staging_bytes = UploadStagingBytes(weight_bytes);
  DeviceRecycler::Buffer staging;
  if (dtype != g->compute_dtype_) {
    LOGPROB_ASSIGN_OR_RETURN(staging, (staging_recycler != nullptr ? *staging_recycler : own).Take(staging_bytes));
  } else if (staging_recycler != nullptr) {
    // No conversion at this precision: an idle staging buffer of an
    // earlier one (up to 64 MiB) is not kept for good (issue 50).
    staging_recycler->TrimIdle(0);
  }
  LOGPROB_RETURN_IF_ERROR(UploadConverted(weight, ElemTypeOf(dtype), n, g->weight_.get(), ElemTypeOf(g->compute_dtype_),
                                          staging.get(), staging_bytes));
  LOGPROB_RETURN_IF_ERROR(g->workspace_.Reserve(kWorkspaceBytes));
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtCreate(&g->handle_), "create");
  const cublasComputeType_t compute =
      g->precision_ == LmHeadPrecision::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&g->op_, compute, CUDA_R_32F), "matmul desc");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->op_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
                             "transa");
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(g->op_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
                             "transb");
  const cudaDataType_t ab = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  LOGPROB_LT_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&g->a_layout_, ab, static_cast<uint64_t>(hidden_size),
                                                        static_cast<uint64_t>(g->stride_), hidden_size),
                             "weight layout");
  LOGPROB_RETURN_IF_ERROR(g->ChooseAlgo());
  return g;
}

absl::Status CublasLtLmHead::ChooseAlgo() {
  Plan ref;
  LOGPROB_RETURN_IF_ERROR(MakeLayouts(algo_rows_, &ref));
  // Callers pass chunks of the hidden states starting at multiples of 16
  // rows: their alignment is that of 16 * H elements (at most 256 bytes).
  const uint32_t b_align = AlignmentOf(16 * static_cast<uint64_t>(hidden_size_) * DTypeSize(compute_dtype_));
  absl::StatusOr<UnsplitAlgo> chosen =
      ChooseUnsplitAlgo(handle_, op_, a_layout_, ref.b, ref.d, workspace_.size(), b_align);
  if (absl::IsNotFound(chosen.status()))
    return absl::InternalError(absl::StrCat("the ", LmHeadPrecisionName(precision_), " lm_head GEMM [", algo_rows_,
                                            ", ", hidden_size_, "] x [", hidden_size_, ", ", rows_,
                                            "]: ", chosen.status().message()));
  LOGPROB_RETURN_IF_ERROR(chosen.status());
  algo_ = chosen->algo;
  algo_summary_ = chosen->summary;
  // Logged once per lm_head load: which kernel every M runs (batch
  // invariance rests on it), and whether a split was forced off.
  std::fprintf(
      stderr,
      "logprob-worker: lm_head GEMM %s [M, %lld] x [%lld, %lld] (algorithm chosen at M = %lld): "
      "cuBLASLt %s, workspace %zu bytes%s\n",
      LmHeadPrecisionName(precision_), static_cast<long long>(hidden_size_), static_cast<long long>(hidden_size_),
      static_cast<long long>(rows_), static_cast<long long>(algo_rows_), algo_summary_.c_str(), chosen->workspace_bytes,
      chosen->forced_from.empty()
          ? ""
          : absl::StrCat(" (the heuristic's split-K / reduction forced off: it chose ", chosen->forced_from, ")")
                .c_str());
  return absl::OkStatus();
}

absl::Status CublasLtLmHead::Compute(const void* hidden, int64_t M, float* logits, cudaStream_t stream) {
  if (M < 0) return absl::InvalidArgumentError(absl::StrCat("negative row count ", M));
  if (M == 0) return absl::OkStatus();
  auto it = plans_.find(M);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    LOGPROB_RETURN_IF_ERROR(MakeLayouts(M, plan.get()));
    // The one algorithm (batch invariance): never a per-M heuristic choice.
    cublasLtMatmulHeuristicResult_t check{};
    const cublasStatus_t s =
        cublasLtMatmulAlgoCheck(handle_, op_, a_layout_, plan->b, plan->d, plan->d, &algo_, &check);
    if (s != CUBLAS_STATUS_SUCCESS || check.workspaceSize > workspace_.size())
      return absl::InternalError(
          absl::StrCat("the lm_head GEMM algorithm chosen at M = ", algo_rows_, " does not run [", M, ", ",
                       hidden_size_, "] x [", hidden_size_, ", ", rows_, "]: ",
                       s != CUBLAS_STATUS_SUCCESS ? std::string(cublasLtGetStatusString(s))
                                                  : absl::StrCat("needs ", check.workspaceSize, " workspace bytes")));
    it = plans_.emplace(M, std::move(plan)).first;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const Plan& p = *it->second;
  // An error an earlier call left on this thread is not this GEMM's: cleared
  // (a sticky one stays and fails the GEMM, as it must).
  CudaRuntimeErrors::GetLastError();
  LOGPROB_RETURN_IF_ERROR(
      LtStatus(cublasLtMatmul(handle_, op_, &alpha, weight_.get(), a_layout_, hidden, p.b, &beta, logits, p.d, logits,
                              p.d, &algo_, workspace_.get(), workspace_.size(), stream),
               "matmul", stream));
  if (transform_.identity()) return absl::OkStatus();
  return CudaStatus(
      LaunchLmHeadTransform(logits, M, stride_, transform_.has_bias ? bias_.get<float>() : nullptr,
                            static_cast<float>(transform_.logit_scale), static_cast<float>(transform_.softcap), stream),
      "lm_head transform kernel");
}

absl::Status CublasLtLmHead::SetTransform(const LmHeadTransform& t, const std::vector<float>& bias) {
  const size_t want = t.has_bias ? static_cast<size_t>(rows_) : 0;
  if (bias.size() != want)
    return absl::InvalidArgumentError(
        absl::StrCat("lm_head bias: ", bias.size(), " elements, ", want, " expected for this slice"));
  if (t.has_bias) {
    std::vector<float> padded(static_cast<size_t>(stride_), 0.0f);
    std::copy(bias.begin(), bias.end(), padded.begin());
    LOGPROB_RETURN_IF_ERROR(bias_.Reserve(padded.size() * sizeof(float)));
    LOGPROB_RETURN_IF_ERROR(UploadAndWait(bias_.get(), padded.data(), padded.size() * sizeof(float)));
  }
  transform_ = t;
  return absl::OkStatus();
}

}  // namespace logprob::cuda
