// The one cuBLASLt algorithm a GEMM runs for every row count (batch
// invariance; worker/cuda/lm_head_gemm_cublaslt.h explains why): the
// heuristic's best candidate at a reference shape that sums each output in
// one sequence (split-K 1, no reduction scheme), chosen once and reused.
// Shared by the lm_head's forward GEMM and the backward's f32 GEMMs
// (lt_f32_matmul.h).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace logprob::cuda {

/// An algorithm ChooseUnsplitAlgo picked.
struct UnsplitAlgo {
  cublasLtMatmulAlgo_t algo{};
  std::string summary;         // its configuration ("id 21, tile 27, stages 18, split-k 1, ...")
  size_t workspace_bytes = 0;  // what it needs at the reference shape
  std::string forced_from;     // not empty: the heuristic's split candidate (its summary), forced to split-K 1
};

/// The heuristic's best algorithm for D = op(A) op(B) (`op`, layouts `a`,
/// `b`, `d`: the reference shape; C is D) that runs with split-K 1 and no
/// reduction scheme within `max_workspace` bytes: first among the
/// candidates the heuristic configured so itself, then any candidate with
/// its split forced off, each checked with cublasLtMatmulAlgoCheck.
/// `b_align`: the smallest alignment in bytes of the B pointers the caller
/// will pass (the preference's minimum). NOT_FOUND naming how many
/// candidates the heuristic offered when none runs unsplit; INTERNAL (or
/// UNAVAILABLE for a device fault) when cuBLASLt fails. Thread-safe for
/// distinct handles.
absl::StatusOr<UnsplitAlgo> ChooseUnsplitAlgo(cublasLtHandle_t handle, cublasLtMatmulDesc_t op,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t d, size_t max_workspace, uint32_t b_align);

/// The largest power of two, at most 256, that divides `bytes` (the
/// alignment of pointers that many bytes apart from a 256-byte aligned
/// start).
uint32_t AlignmentOf(uint64_t bytes);

/// The Status of a cuBLASLt call (LtStatusOf, lt_status.h), the context
/// asked through `stream`'s query (the legacy stream's when null).
absl::Status LtStatus(cublasStatus_t s, const char* what, cudaStream_t stream = nullptr);

}  // namespace logprob::cuda
