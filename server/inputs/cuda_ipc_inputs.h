// CUDA IPC inputs (Tensor.cuda_ipc, proto/logprob/v1/logprob.proto): a
// same-host client's hidden states stay in its GPU allocation; each worker
// maps its own rows of it (WorkItem.cuda_ipc, worker/cuda/cuda_ipc.h).
// The front-end only validates the reference and plans with it: it never
// reads the bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"
#include "server/inputs/input_source.h"

namespace logprob {

/// Bytes of a cudaIpcMemHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

/// Why CUDA IPC inputs are or are not available on this server: the
/// --cuda-ipc-inputs flag, the workers' backend, where they run and how
/// they exchange hidden states (a device pointer can only be scored in one
/// pass, ScoringBackend::OnePassHidden: one worker, or device collectives,
/// which CUDA workers have over NCCL and over Gloo).
struct CudaIpcAvailability {
  bool flag = true;           // --cuda-ipc-inputs
  bool cuda_workers = false;  // --backend cuda
  bool same_host = false;     // workers started by this server on its host
  bool one_pass = false;      // --workers 1 or device collectives (CUDA workers, NCCL or Gloo)
  int workers = 0;            // for the message
  std::string comm;           // for the message
  /// True when every condition holds (ServerInfo.cuda_ipc_inputs).
  bool available() const { return flag && cuda_workers && same_host && one_pass; }
};

/// The availability of CUDA IPC inputs for `flag` (--cuda-ipc-inputs) on a
/// pool of `workers` workers of `backend` ("cpu", "cuda") over `comm`,
/// `same_host` when this server started them on its host. CUDA workers have
/// device collectives over either communicator (NCCL's own, Gloo's staged
/// through host memory: worker/backend_factory.h).
CudaIpcAvailability CudaIpcAvailabilityOf(bool flag, const std::string& backend, const std::string& comm, int workers,
                                          bool same_host);

/// OK when a CUDA IPC input from `peer` (grpc::ServerContext::peer(); ""
/// without a call) can be served; else FAILED_PRECONDITION saying why
/// (flag off, CPU workers, workers on other hosts, several workers without
/// device collectives, a peer that is not on this host) and that the client should send
/// `payload` ("the hidden states", "the rows") as bytes (inline or through
/// shared memory) instead; the reason is CUDA_IPC_UNAVAILABLE.
absl::Status CheckCudaIpcAvailable(const CudaIpcAvailability& availability, const std::string& peer,
                                   const std::string& payload = "the hidden states");

/// The source of input `index` of a request, `tensor`, whose bytes are in
/// a same-host client's CUDA allocation (tensor.cuda_ipc): the front-end
/// never reads them; planned work items refer the workers to their rows
/// (WorkItem.cuda_ipc). CheckCudaIpcAvailable's errors, or
/// INVALID_ARGUMENT (naming the tensor) for a handle that is not 64 bytes,
/// a negative offset, byte_size or allocation_bytes, an offset that is not
/// a multiple of the dtype's size, byte_size != product(shape) *
/// sizeof(dtype), or (allocation_bytes > 0) bytes [offset, offset +
/// byte_size) past allocation_bytes; work items carry allocation_bytes so
/// that the worker checks it against the allocation it maps. Which
/// tensors and options may use it: RulesOf(InputKind::kCudaIpc); the rows
/// of an lm_head update too (ScoringCore::ResolveTensor; `payload` names
/// them in the advice to send bytes instead).
absl::StatusOr<std::shared_ptr<const InputSource>> ResolveCudaIpc(const v1::Tensor& tensor, int index,
                                                                  const CudaIpcAvailability& availability,
                                                                  const std::string& peer,
                                                                  const std::string& payload = "the hidden states");

}  // namespace logprob
