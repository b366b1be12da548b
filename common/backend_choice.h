// The --backend / --comm choices shared by logprob-server and
// logprob-worker, and whether this build has the CUDA backend.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace logprob {

/// True when the CUDA backend was built (nvcc found at configure time and
/// LOGPROB_ENABLE_CUDA on).
constexpr bool kCudaBuilt =
#ifdef LOGPROB_HAVE_CUDA
    true;
#else
    false;
#endif

/// Checks --backend (cpu | cuda) and --comm (gloo | nccl): nccl needs
/// cuda, and cuda needs a build with CUDA. INVALID_ARGUMENT naming the
/// flag otherwise.
inline absl::Status CheckBackendChoice(const std::string& backend, const std::string& comm) {
  if (backend != "cpu" && backend != "cuda")
    return absl::InvalidArgumentError("--backend " + backend + ": must be cpu or cuda");
  if (comm != "gloo" && comm != "nccl") return absl::InvalidArgumentError("--comm " + comm + ": must be gloo or nccl");
  if (backend == "cuda" && !kCudaBuilt)
    return absl::InvalidArgumentError(
        "--backend cuda: this build has no CUDA backend (nvcc was not found at configure time, or "
        "-DLOGPROB_ENABLE_CUDA=OFF); rebuild with the CUDA toolkit and NCCL installed");
  if (comm == "nccl" && backend != "cuda")
    return absl::InvalidArgumentError("--comm nccl needs --backend cuda (NCCL moves device buffers)");
  return absl::OkStatus();
}

}  // namespace logprob
