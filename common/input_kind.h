// Where a request tensor's bytes come from, and what each kind of source
// allows: the one rule the front-end (validation, batching, planning) and
// the workers (scoring path) both follow.
#pragma once

#include <string>

#include "logprob/v1/logprob.pb.h"

namespace logprob {

/// The source of a tensor's bytes (public Tensor.source, or LmHeadRows.file).
enum class InputKind {
  kBytes,         // Tensor.data, inline or assembled from ScoreChunked pieces
  kSharedMemory,  // Tensor.shared_memory: a region the client registered
  kCudaIpc,       // Tensor.cuda_ipc: a same-host client's CUDA allocation
  kFile,          // a safetensors checkpoint the server reads (lm_head updates only: LmHeadRows.file)
};

/// What a kind of source allows.
struct InputKindRules {
  const char* name;  // for messages: "bytes", "shared memory", "CUDA IPC"
  /// The front-end reads the bytes itself (copies them into work items);
  /// false: the workers read them where they are (a reference travels).
  bool readable_here;
  /// May share a worker batch with other requests (server/core/batcher.h);
  /// a reference to the client's memory always runs alone.
  bool batchable;
  /// The workers need every input row as one contiguous range (a
  /// reference cannot leave out the unscored rows); the front-end then
  /// plans every input row and drops the unscored ones from the answer.
  bool every_input_row;
  /// Sampling filters (options.sampling_top_k / sampling_top_p) can be
  /// applied: the filtered path scores hidden states in rounds through
  /// host memory, which needs bytes readable on the host.
  bool sampling_filters;
  /// Only hidden_states may come from this kind.
  bool hidden_states_only;
  /// The workers must score it in one pass (CanScoreInOnePass).
  bool needs_one_pass;
  /// The reason (logprob.v1.ErrorReason) of errors that say this server or
  /// this call cannot use the kind: the client sends the bytes instead.
  v1::ErrorReason unavailable;
};

/// The rules of `kind`.
const InputKindRules& RulesOf(InputKind kind);

/// The kind of `tensor`'s source (kBytes when none is set).
InputKind KindOf(const v1::Tensor& tensor);

/// True when `options` ask for sampling filters: sampling_top_k > 0 or
/// sampling_top_p < 1 (NeMo-RL apply_top_k_top_p semantics).
bool HasSamplingFilters(const v1::ScoreOptions& options);

/// True when hidden states spread over `workers` workers can be scored in
/// one pass on the device: one worker, or a communicator with device
/// collectives (CUDA workers: NCCL's, or Gloo's staged through host
/// memory). The front-end (whether CUDA IPC inputs
/// can be served) and the CUDA backend (ScoringBackend::OnePassHidden)
/// both decide by it.
bool CanScoreInOnePass(int workers, bool device_collectives);

}  // namespace logprob
