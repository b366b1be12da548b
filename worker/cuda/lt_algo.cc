#include "worker/cuda/lt_algo.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/lt_status.h"

namespace logprob::cuda {
namespace {

/// One configuration attribute of `algo` (T: its documented type); 0 when
/// cuBLASLt cannot say.
template <typename T>
int64_t AlgoAttribute(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof value, &written) != CUBLAS_STATUS_SUCCESS)
    return 0;
  return static_cast<int64_t>(value);
}

/// Whether the heuristic's own configuration of `algo` splits the inner
/// dimension (split-K > 1 or a reduction scheme): the split would then be
/// a property of the candidate, chosen for the reference shape.
bool SplitsK(const cublasLtMatmulAlgo_t& algo) {
  return AlgoAttribute<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1 ||
         AlgoAttribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) != CUBLASLT_REDUCTION_SCHEME_NONE;
}

/// "id 21, tile 27, stages 18, split-k 1, reduction 0, swizzle 0, custom
/// option 0, inner shape 0, cluster shape 0": what the logs name.
std::string AlgoSummary(const cublasLtMatmulAlgo_t& algo) {
  return absl::StrCat("id ", AlgoAttribute<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID), ", tile ",
                      AlgoAttribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID), ", stages ",
                      AlgoAttribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID), ", split-k ",
                      AlgoAttribute<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), ", reduction ",
                      AlgoAttribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), ", swizzle ",
                      AlgoAttribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), ", custom option ",
                      AlgoAttribute<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), ", inner shape ",
                      AlgoAttribute<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID), ", cluster shape ",
                      AlgoAttribute<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

}  // namespace

absl::Status LtStatus(cublasStatus_t s, const char* what, cudaStream_t stream) {
  return LtStatusOf(s, what, [stream] { return cudaStreamQuery(stream); });
}

uint32_t AlignmentOf(uint64_t bytes) {
  if (bytes == 0) return 256;
  return static_cast<uint32_t>(std::min<uint64_t>(256, bytes & (~bytes + 1)));
}

absl::StatusOr<UnsplitAlgo> ChooseUnsplitAlgo(cublasLtHandle_t handle, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t d, size_t max_workspace, uint32_t b_align) {
  const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
  constexpr int kCandidates = 8;
  int found_total = 0;
  // First only the algorithms that sum each output in one sequence (the
  // preference's reduction-scheme mask NONE); should that leave none, any
  // candidate, run with split-K forced to 1 below all the same.
  for (const bool only_unsplit : {true, false}) {
    cublasLtMatmulPreference_t pref = nullptr;
    LOGPROB_RETURN_IF_ERROR(LtStatus(cublasLtMatmulPreferenceCreate(&pref), "preference"));
    absl::Cleanup destroy = [pref] { cublasLtMatmulPreferenceDestroy(pref); };
    // A preference that did not take (e.g. the reduction mask) would let
    // the heuristic pick what batch invariance rules out: checked.
    LOGPROB_RETURN_IF_ERROR(
        LtStatus(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                                      sizeof max_workspace),
                 "preference: max workspace bytes"));
    if (only_unsplit)
      LOGPROB_RETURN_IF_ERROR(
          LtStatus(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &no_reduction,
                                                        sizeof no_reduction),
                   "preference: reduction scheme mask"));
    LOGPROB_RETURN_IF_ERROR(LtStatus(cublasLtMatmulPreferenceSetAttribute(
                                         pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b_align, sizeof b_align),
                                     "preference: minimum alignment of B"));
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int found = 0;
    const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, pref, kCandidates, results, &found);
    std::move(destroy).Invoke();
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) continue;  // no candidate under this preference
    LOGPROB_RETURN_IF_ERROR(LtStatus(s, "heuristic"));
    found_total += found;
    // The heuristic's best candidate that runs with split-K 1, no reduction:
    // first among those it configured so itself, then any (forced).
    const int32_t splitk = 1;
    for (int i = 0; i < 2 * found; ++i) {
      const bool forced = i >= found;
      const cublasLtMatmulHeuristicResult_t& r = results[i % found];
      if (r.state != CUBLAS_STATUS_SUCCESS || SplitsK(r.algo) != forced) continue;
      cublasLtMatmulAlgo_t algo = r.algo;
      if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk) !=
              CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction,
                                               sizeof no_reduction) != CUBLAS_STATUS_SUCCESS)
        continue;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(handle, op, a, b, d, d, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > max_workspace)
        continue;
      UnsplitAlgo chosen;
      chosen.algo = algo;
      chosen.summary = AlgoSummary(algo);
      chosen.workspace_bytes = check.workspaceSize;
      if (forced) chosen.forced_from = AlgoSummary(r.algo);
      return chosen;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("cuBLASLt has no split-K-free algorithm (", found_total, " heuristic candidate(s))"));
}

}  // namespace logprob::cuda
