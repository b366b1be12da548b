#include "server/inputs/input_resolver.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/error_reason.h"
#include "common/input_kind.h"
#include "common/shared_memory.h"
#include "server/inputs/shared_inputs.h"

namespace logprob {

InputResolver::InputResolver(InputResolverOptions options) : cuda_ipc_(std::move(options.cuda_ipc)) {
  if (options.shared_memory_inputs)
    regions_ = std::make_unique<ClientRegions>(std::move(options.shared_memory_regions));
  if (regions_ || cuda_ipc_.available()) host_id_ = SharedMemoryHostId();
}

InputContext InputResolver::Context(const InputCaller& caller) const {
  InputContext context;
  context.regions = regions_.get();
  context.session = caller.session;
  context.peer = caller.peer;
  context.cuda_ipc = cuda_ipc_;
  return context;
}

absl::StatusOr<RequestInputs> InputResolver::Resolve(const v1::ScoreRequest& req, const InputCaller& caller) {
  return ResolveInputs(req, Context(caller));
}

absl::StatusOr<std::shared_ptr<const InputSource>> InputResolver::ResolveTensor(const v1::Tensor& tensor,
                                                                                const std::string& what,
                                                                                const InputCaller& caller) {
  switch (KindOf(tensor)) {
    case InputKind::kBytes:
      return MemorySource(tensor.data());  // views the caller's tensor
    case InputKind::kCudaIpc: {
      // Offered as for scoring inputs (ServerInfo.cuda_ipc_inputs, a local
      // peer); a worker copies the rows (LmHeadUpdates' stage). Not through
      // ResolveInputs, whose rules keep CUDA IPC to hidden_states.
      absl::StatusOr<std::shared_ptr<const InputSource>> source =
          ResolveCudaIpc(tensor, 0, cuda_ipc_, caller.peer, "the rows");
      if (!source.ok()) return Prefixed(source.status(), what);
      return source;
    }
    default: {
      v1::ScoreRequest one;
      *one.add_inputs() = tensor;  // a reference: no bytes are copied
      absl::StatusOr<RequestInputs> resolved = ResolveInputs(one, Context(caller));
      if (!resolved.ok())
        return absl::Status(resolved.status().code(),
                            absl::StrCat(what, ": ", resolved.status().message()));  // names the field, not inputs[0]
      return resolved->sources.front();
    }
  }
}

void InputResolver::Describe(v1::ServerInfo* info) const {
  info->set_shared_memory_inputs(regions_ != nullptr);
  info->set_cuda_ipc_inputs(cuda_ipc_.available());
  info->set_host_id(host_id_);
  if (regions_) {
    const ClientRegions::Options& o = regions_->options();
    info->set_max_shared_memory_bytes(o.max_bytes);
    info->set_max_shared_memory_regions(o.max_regions);
    info->set_shared_memory_idle_timeout_seconds(std::chrono::duration<double>(o.idle_timeout).count());
  }
}

absl::Status InputResolver::SharedMemoryEnabled() const {
  return regions_ ? absl::OkStatus() : SharedMemoryInputsOff();
}

absl::StatusOr<RegionChallenge> InputResolver::RegisterSharedMemory(const std::string& session, const std::string& name,
                                                                    const std::string& shm_name, int64_t byte_size) {
  if (absl::Status st = SharedMemoryEnabled(); !st.ok()) return st;
  return regions_->Register(session, name, shm_name, byte_size);
}

absl::Status InputResolver::ConfirmSharedMemory(const std::string& session, const std::string& name) {
  if (absl::Status st = SharedMemoryEnabled(); !st.ok()) return st;
  return regions_->Confirm(session, name);
}

absl::StatusOr<int> InputResolver::UnregisterSharedMemory(const std::string& session, const std::string& name) {
  if (absl::Status st = SharedMemoryEnabled(); !st.ok()) return st;
  return regions_->Unregister(session, name);
}

absl::StatusOr<std::vector<ClientRegions::Listed>> InputResolver::ListSharedMemory(const std::string& session) {
  if (absl::Status st = SharedMemoryEnabled(); !st.ok()) return st;
  return regions_->List(session);
}

}  // namespace logprob
