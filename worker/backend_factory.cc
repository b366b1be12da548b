#include "worker/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "common/backend_choice.h"
#include "common/status_macros.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/host_staged_device_collectives.h"
#include "worker/kernels/lm_head_gemm.h"
#include "worker/scoring/cpu_backend.h"
#ifdef LOGPROB_HAVE_CUDA
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/cuda_device_copy.h"
#include "worker/cuda/device_info.h"
#include "worker/cuda/nccl_communicator.h"
#endif

namespace logprob {

absl::StatusOr<std::unique_ptr<ScoringBackend>> MakeBackend(const BackendConfig& config) {
  LOGPROB_RETURN_IF_ERROR(CheckBackendChoice(config.backend, "gloo"));
  if (config.backend == "cpu") {
    return std::unique_ptr<ScoringBackend>(new CpuBackend(config.threads, config.lm_head_cpu_kernel));
  }
#ifdef LOGPROB_HAVE_CUDA
  LOGPROB_ASSIGN_OR_RETURN(const int device, cuda::SelectDevice(config.device, config.rank));
  LOGPROB_ASSIGN_OR_RETURN(auto b, cuda::CudaBackend::Create(device, cuda::CudaBackend::Options()));
  return std::unique_ptr<ScoringBackend>(std::move(b));
#else
  return absl::InternalError("unreachable: CheckBackendChoice accepted cuda in a build without CUDA");
#endif
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeCommunicator(const std::string& comm, ScoringBackend& backend,
                                                               gloo::rendezvous::Store& store,
                                                               const std::string& hostname, int rank, int size,
                                                               std::chrono::milliseconds timeout) {
  LOGPROB_RETURN_IF_ERROR(CheckBackendChoice(backend.name(), comm));
#ifdef LOGPROB_HAVE_CUDA
  auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
#endif
  if (comm == "gloo") {
    LOGPROB_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c,
                             GlooCommunicator::Create(store, hostname, rank, size, timeout));
#ifdef LOGPROB_HAVE_CUDA
    // CUDA workers over Gloo get device collectives staged through host
    // memory, so they score hidden states in one pass as over NCCL (and
    // several workers may share one GPU, which NCCL refuses).
    if (cuda_backend) {
      LOGPROB_ASSIGN_OR_RETURN(std::unique_ptr<DeviceCopy> copy, cuda::CudaDeviceCopy::Create(cuda_backend->device()));
      c = std::make_unique<HostStagedDeviceCollectives>(std::move(c), std::move(copy));
    }
#endif
    return c;
  }
#ifdef LOGPROB_HAVE_CUDA
  if (!cuda_backend) return absl::InvalidArgumentError("--comm nccl needs --backend cuda");
  LOGPROB_ASSIGN_OR_RETURN(const int devices, cuda::DeviceCount());
  if (size > devices)
    return absl::FailedPreconditionError(absl::StrCat("--comm nccl needs one GPU per worker: ", size, " workers, ",
                                                      devices, " GPU(s); use --comm gloo to share GPUs"));
  // NCCL on a stream of its own: the backend's one-pass items wait for
  // their inputs before a device collective and do not hold the backend's
  // streams while it runs, so token-parallel items never queue behind one.
  LOGPROB_ASSIGN_OR_RETURN(auto c, cuda::NcclCommunicator::Create(store, rank, size, cuda_backend->device(),
                                                                  /*stream=*/nullptr, timeout));
  return std::unique_ptr<Communicator>(std::move(c));
#else
  return absl::InternalError("unreachable: CheckBackendChoice accepted nccl in a build without CUDA");
#endif
}

}  // namespace logprob
