// Builds the worker's ScoringBackend and Communicator from the --backend
// and --comm choices (common/backend_choice.h).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/lm_head_cpu_kernel.h"
#include "common/lm_head_precision.h"
#include "gloo/rendezvous/store.h"
#include "worker/comm/communicator.h"
#include "worker/scoring/backend.h"

namespace logprob {

/// What a worker's backend is built from.
struct BackendConfig {
  std::string backend = "cpu";  // cpu | cuda
  int rank = 0;
  int device = -1;  // cuda: CUDA device; -1: rank % device count (several workers may share one GPU)
  int threads = 0;  // cpu: GEMM threads (0: library default)
  // cpu: the bf16 lm_head GEMM's kernel, the pool's (JoinReply.lm_head_cpu_kernel)
  LmHeadCpuKernel lm_head_cpu_kernel = LmHeadCpuKernel::kAuto;
};

/// The backend named in `config`. INVALID_ARGUMENT for an unknown or
/// unbuilt backend (CheckBackendChoice's message); FAILED_PRECONDITION for
/// cuda without a usable device or CUDA / cuBLASLt set-up errors.
/// lm_heads are loaded afterwards (ScoringBackend::LoadLmHead).
absl::StatusOr<std::unique_ptr<ScoringBackend>> MakeBackend(const BackendConfig& config);

/// The communicator `comm` (gloo | nccl) of rank `rank` of `size`,
/// bootstrapped through `store` (the front-end's key-value store). nccl
/// needs a cuda `backend` with a GPU per rank (FAILED_PRECONDITION when
/// ranks would share one). gloo with a cuda `backend` has device
/// collectives staged through host memory (HostStagedDeviceCollectives),
/// so both CUDA communicators score hidden states in one pass. `hostname`: where Gloo listens. UNAVAILABLE when
/// the rendezvous fails.
absl::StatusOr<std::unique_ptr<Communicator>> MakeCommunicator(const std::string& comm, ScoringBackend& backend,
                                                               gloo::rendezvous::Store& store,
                                                               const std::string& hostname, int rank, int size,
                                                               std::chrono::milliseconds timeout);

}  // namespace logprob
