// The version of the internal front-end <-> worker protocol.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace logprob {

/// Version of the internal front-end <-> worker protocol: the messages of
/// proto/logprob/internal/v1/worker.proto and what they mean (layouts,
/// the packed partial record, shared-memory payloads, the control plane).
/// A worker sends its version in JoinRequest.protocol_version; the
/// front-end refuses any other (FAILED_PRECONDITION) and sends its own in
/// JoinReply.protocol_version, which the worker checks too (a front-end of
/// an older release leaves it 0). Bump it with every change that a worker
/// or front-end of the previous release would misread.
/// 2: JoinReply.lm_head_precision (a version-1 worker would ignore it and
/// compute in the default precision).
/// 3: WorkItem.payload, one oneof (data, shared_memory, cuda_ipc) instead
/// of the loose fields 13 and 15-20.
/// 4: named, versioned lm_heads: JoinReply.lm_heads (repeated, instead of
/// the single lm_head), WorkItem.lm_head, Worker.LoadLmHead / DropLmHead.
/// 5: Worker.Stop and the run id of every Run call (kRunIdMetadataKey): the
/// front-end stops a run's items with Stop instead of cancelling the calls.
/// 6: Worker.StageLmHeadRows (lm_head update rows from a CUDA IPC handle,
/// copied by a worker into the staged store file).
/// 7: ScoreOptions.log_sum_sq_probs / mean_logits / is_top1 and
/// WorkResult.log_sum_sq_probs / mean_logits / is_top1 (a version-6 worker
/// would ignore the options and return none); the partial record's header
/// grew from 6 to 12 words (q, zsum, pre_target_max); and LmHeadSource's
/// logit transform (bias, logit_scale, final_logit_softcapping), which a
/// version-6 worker would ignore, scoring such a head without it.
/// 8: LmHeadRef.serial, the identity of an lm_head version: workers load,
/// find and drop by (name, version, serial); a version-7 worker would key
/// by name and version alone and could drop a current version that reuses
/// a released one's name.
/// 9: a worker's failed call carries its error reason (logprob.v1.ErrorReason)
/// as the trailing metadata kReasonMetadataKey, which the front-end passes
/// on unchanged instead of relabelling FAILED_PRECONDITION of a CUDA IPC
/// item as CUDA_IPC_UNAVAILABLE; a version-8 worker would send none, and
/// its clients would no longer fall back to bytes when it cannot open a
/// handle.
/// 10: an authenticated internal plane: every Control and Worker call
/// carries the pool secret (common/internal_auth.h, kPoolSecretMetadataKey)
/// and every Run call its pool generation (kGenerationMetadataKey), which
/// the worker checks; JoinReply.payload_region_prefix (the only
/// shared-memory names a worker opens); LmHeadRowsRequest.generation. A
/// version-9 worker sends no secret and is refused UNAUTHENTICATED.
/// 11: JoinReply.lm_head_cpu_kernel, the pool's one CPU kernel for the
/// bf16 lm_head GEMM (common/lm_head_cpu_kernel.h); a version-10 worker
/// would pick its own by its CPU, and a pool on mixed CPUs would compute
/// other bits on some ranks.
/// 12: WorkItem.mask_offsets / mask_ids / masked, the rows' sampling masks
/// (docs/SPEC.md "Sampling masks"); a version-11 worker would ignore them
/// and score over the whole vocabulary.
/// 13: the lm_head's backward (WorkItem.backward, grad_token_logprobs,
/// grad_entropy; WorkResult.grad_hidden_states), the gradient steps'
/// budget in JoinReply and Worker.ReadHeadGradients /
/// CloseHeadGradientStep; a version-12 worker would answer a backward
/// item as a forward.
/// 14: full-vocabulary distillation (WorkItem.distillation;
/// WorkResult.divergence, cross_entropy); a version-13 worker would answer
/// a distillation item as a forward of the student.
constexpr uint32_t kWorkerProtocolVersion = 14;

/// gRPC metadata key of every Worker.Run call: the run's id (decimal), the
/// same for all items of one WorkerPool::Run, which Worker.Stop names.
inline constexpr char kRunIdMetadataKey[] = "logprob-run-id";

/// gRPC metadata key of every Worker.Run call: the pool generation
/// (decimal) the front-end planned the item for; a worker of another
/// generation refuses the item (FAILED_PRECONDITION) without running it.
inline constexpr char kGenerationMetadataKey[] = "logprob-generation";

/// The message both sides give when the worker's build (common/version.h
/// BuildId) is not the front-end's.
inline std::string BuildMismatch(const std::string& worker_build, const std::string& frontend_build) {
  return absl::StrCat("worker build \"", worker_build, "\" is not the front-end's build \"", frontend_build,
                      "\"; run the front-end and the workers from the same build");
}

/// The message both sides give for a version mismatch.
inline std::string ProtocolMismatch(uint32_t worker_version, uint32_t frontend_version) {
  return absl::StrCat("worker protocol version ", worker_version, " does not match the front-end's version ",
                      frontend_version,
                      " (0: a release from before versioning); run the front-end and the workers from the same "
                      "release");
}

}  // namespace logprob
