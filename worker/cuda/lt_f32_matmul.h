// A float32 cuBLASLt matmul with one algorithm for every column count:
// D[m, n] = op(A)[m, k] op(B)[k, n] + beta D, column-major, f32 operands,
// CUBLAS_COMPUTE_32F (no TF32). The algorithm is chosen once, at a
// reference n, split-K 1 and no reduction scheme (lt_algo.h), so a column
// of D is summed in the same sequence, bitwise the same, whatever n and its
// place among the columns. The lm_head backward's GEMMs
// (cuda_slice_backward.h): dL/dh of a row is such a column.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace logprob::cuda {

/// Not thread-safe (one stream at a time).
class LtF32Matmul {
 public:
  struct Shape {
    bool trans_a = false;  // A stored [k, m] (ld lda) and transposed; else stored [m, k]
    bool trans_b = false;  // B stored [n, k] (ld ldb) and transposed; else stored [k, n]
    int64_t m = 0, k = 0;
    int64_t lda = 0, ldb = 0, ldd = 0;
    int64_t ref_n = 256;    // the n the algorithm is chosen at
    uint32_t b_align = 16;  // the smallest alignment in bytes of the B pointers Run gets
  };
  /// Picks the algorithm on `handle` (owned by the caller, outliving
  /// this) within `max_workspace` bytes. `name` names the matmul in errors
  /// and, with `log_choice`, in a line on stderr naming the choice
  /// (algo_summary() either way). INVALID_ARGUMENT for a bad shape;
  /// INTERNAL when cuBLASLt fails or offers no unsplit algorithm.
  static absl::StatusOr<std::unique_ptr<LtF32Matmul>> Create(cublasLtHandle_t handle, const Shape& shape,
                                                             size_t max_workspace, std::string name,
                                                             bool log_choice = true);
  /// The chosen algorithm's configuration (lt_algo.h UnsplitAlgo::summary).
  const std::string& algo_summary() const { return algo_summary_; }
  ~LtF32Matmul();

  /// D = op(A) op(B) + beta D for n columns, asynchronous on `stream`;
  /// a, b, d device pointers (b at least Shape::b_align-aligned, the
  /// others 256-byte aligned), `workspace` at least the Create's
  /// max_workspace bytes. INTERNAL when the algorithm does not run this n
  /// (cublasLtMatmulAlgoCheck) or cuBLASLt fails; n == 0 does nothing.
  absl::Status Run(const float* a, const float* b, float* d, int64_t n, float beta, void* workspace,
                   cudaStream_t stream);

 private:
  struct Plan;  // B and D layouts for one n
  LtF32Matmul() = default;
  absl::Status MakeLayouts(int64_t n, Plan* plan) const;
  cublasLtHandle_t handle_ = nullptr;
  Shape shape_;
  size_t max_workspace_ = 0;
  std::string name_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  std::string algo_summary_;
  std::map<int64_t, std::unique_ptr<Plan>> plans_;
};

}  // namespace logprob::cuda
