// CUDA IPC inputs (Tensor.cuda_ipc, proto/logprob/v1/logprob.proto): a
// same-host client's hidden states stay in its GPU allocation; each worker
// maps its own rows of it (WorkItem.payload_cuda_ipc_*, worker/cuda/cuda_ipc.h).
// The front-end only validates the reference and plans with it: it never
// reads the bytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "logprob/v1/logprob.pb.h"
#include "server/score_job.h"

namespace logprob {

/// Bytes of a cudaIpcMemHandle_t.
inline constexpr size_t kCudaIpcHandleBytes = 64;

/// Why CUDA IPC inputs are or are not available on this server: the
/// --cuda-ipc-inputs flag, the workers' backend, where they run and how
/// they exchange hidden states (a device pointer can only be scored in one
/// pass, ScoringBackend::OnePassHidden: one worker, or NCCL's device
/// collectives).
struct CudaIpcAvailability {
  bool flag = true;           // --cuda-ipc-inputs
  bool cuda_workers = false;  // --backend cuda
  bool same_host = false;     // workers started by this server on its host
  bool one_pass = false;      // --workers 1 or --comm nccl
  int workers = 0;            // for the message
  std::string comm;           // for the message
  /// True when every condition holds (ServerInfo.cuda_ipc_inputs).
  bool available() const { return flag && cuda_workers && same_host && one_pass; }
};

/// The CUDA IPC input of a request (its hidden_states tensor).
struct CudaIpcInput {
  int index = -1;         // in ScoreRequest.inputs
  std::string handle;     // kCudaIpcHandleBytes bytes
  int64_t offset = 0;     // of the tensor's first byte in the allocation
  int64_t byte_size = 0;  // product(shape) * sizeof(dtype)
  std::string device_uuid;
};

/// The request's CUDA IPC input, or nullopt when no tensor has one.
/// INVALID_ARGUMENT (naming the tensor) for: a reference on a tensor other
/// than hidden_states, together with data or shared_memory, a handle that
/// is not 64 bytes, a negative offset or byte_size, an offset that is not
/// a multiple of the dtype's size, byte_size != product(shape) *
/// sizeof(dtype).
absl::StatusOr<std::optional<CudaIpcInput>> FindCudaIpcInput(const v1::ScoreRequest& req);

/// OK when a CUDA IPC input from `peer` (grpc::ServerContext::peer(); ""
/// without a call) can be served; else FAILED_PRECONDITION saying why
/// (flag off, CPU workers, workers on other hosts, several workers over
/// Gloo, a peer that is not on this host) and that the client should send
/// the bytes inline or through shared memory instead.
absl::Status CheckCudaIpcAvailable(const CudaIpcAvailability& availability, const std::string& peer);

/// OK unless `options` ask for sampling filters (sampling_top_k > 0 or
/// sampling_top_p < 1): the filtered path exchanges full logits rows
/// through host memory, so it cannot start from a device pointer.
/// FAILED_PRECONDITION naming the options and what to send instead.
absl::Status CheckCudaIpcOptions(const v1::ScoreOptions& options);

/// A stand-in for the tensor's bytes that BuildScoreJob can address but
/// nothing may read: `byte_size` bytes from a fixed fake address.
std::string_view CudaIpcPlaceholder(int64_t byte_size);

/// Turns `job`, built by BuildScoreJob over CudaIpcPlaceholder(input.byte_size),
/// into a job over every input row (input.byte_size / job.row_bytes rows, in
/// order), so that each worker's share of rows is one contiguous range of the
/// client's allocation: rows that are not scored (padding, the last position
/// of a sequence under next_token) get target -1, gather ids 0 and out_pos -1
/// (BuildResponse drops them). Sets job.cuda_ipc.
void ExpandToInputRows(const CudaIpcInput& input, ScoreJob* job);

}  // namespace logprob
