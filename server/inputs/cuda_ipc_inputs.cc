#include "server/inputs/cuda_ipc_inputs.h"

#include <atomic>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/error_reason.h"
#include "common/input_kind.h"
#include "common/loopback.h"
#include "common/status_macros.h"

namespace logprob {

CudaIpcAvailability CudaIpcAvailabilityOf(bool flag, const std::string& backend, const std::string& comm, int workers,
                                          bool same_host) {
  CudaIpcAvailability a;
  a.flag = flag;
  a.cuda_workers = backend == "cuda";
  a.same_host = same_host;
  a.workers = workers;
  a.comm = comm;
  a.one_pass = CanScoreInOnePass(workers, /*device_collectives=*/a.cuda_workers);
  return a;
}
namespace {

/// The advice that ends every "cannot serve it" message.
std::string Instead(const std::string& payload) {
  return absl::StrCat("; send ", payload, " as bytes (inline or through shared memory) instead");
}

/// Bytes of a client's CUDA allocation: never read here, referred to.
class InClientGpu final : public InputSource {
 public:
  InClientGpu(std::string handle, int64_t offset, int64_t byte_size, int64_t allocation_bytes)
      : InputSource(InputKind::kCudaIpc, byte_size),
        handle_(std::move(handle)),
        offset_(offset),
        allocation_bytes_(allocation_bytes) {}
  bool Read(int64_t, size_t n, char* dst) const override {
    std::memset(dst, 0, n);
    read_ = true;
    return false;
  }
  /// OK unless something tried to Read it (status() reports failed reads
  /// only: a job whose workers read the allocation themselves is fine).
  absl::Status status() const override {
    if (!read_) return absl::OkStatus();
    return absl::InternalError("the front-end cannot read a CUDA IPC input (a work item was planned with its bytes)");
  }
  bool Refer(int64_t offset, int64_t n, internal::v1::WorkItem* item) const override {
    internal::v1::CudaIpcPayload* p = item->mutable_cuda_ipc();
    p->set_handle(handle_);
    p->set_offset(offset_ + offset);
    p->set_byte_size(n);
    p->set_allocation_bytes(allocation_bytes_);
    return true;
  }

 private:
  const std::string handle_;
  const int64_t offset_;                   // of the tensor's first byte in the allocation
  const int64_t allocation_bytes_;         // the allocation's size the client sent; 0: not given
  mutable std::atomic<bool> read_{false};  // a Read was tried (a planning bug)
};

/// Why CUDA IPC inputs cannot be served (OK when they can).
absl::Status Unavailable(const CudaIpcAvailability& a, const std::string& peer, const std::string& payload) {
  const std::string kInstead = Instead(payload);
  if (!a.flag)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC inputs are disabled on this server (--cuda-ipc-inputs=false)", kInstead));
  if (!a.cuda_workers)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC inputs need CUDA workers; this server's workers run the CPU backend", kInstead));
  if (!a.same_host)
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC inputs need workers on the server's host; this server's workers were started elsewhere "
                     "(--external-workers)",
                     kInstead));
  if (!a.one_pass)
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA IPC inputs need one worker or workers with device collectives (the workers read the client's GPU "
        "memory in one pass); this server has ",
        a.workers, " workers over ", a.comm, kInstead));
  if (!IsLocalPeer(peer))
    return absl::FailedPreconditionError(absl::StrCat("CUDA IPC inputs are for clients on the server's host; peer \"",
                                                      peer, "\" is not local", kInstead));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const InputSource>> ResolveCudaIpc(const v1::Tensor& t, int index,
                                                                  const CudaIpcAvailability& availability,
                                                                  const std::string& peer, const std::string& payload) {
  const std::string what = absl::StrCat("inputs[", index, "] \"", t.name(), "\": cuda_ipc");
  const v1::CudaIpcRef& ref = t.cuda_ipc();
  if (ref.handle().size() != kCudaIpcHandleBytes)
    return absl::InvalidArgumentError(absl::StrCat(what, ".handle is ", ref.handle().size(),
                                                   " bytes; a cudaIpcMemHandle_t is ", kCudaIpcHandleBytes));
  if (ref.offset() < 0 || ref.byte_size() < 0 || ref.allocation_bytes() < 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", ref.offset(), ", byte_size ", ref.byte_size(),
                                                   " and allocation_bytes ", ref.allocation_bytes(), " must be >= 0"));
  const size_t esize = DTypeSize(t.dtype());
  if (esize == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": dtype is unspecified"));
  if (ref.offset() % static_cast<int64_t>(esize) != 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ".offset ", ref.offset(), " is not a multiple of ",
                                                   DTypeName(t.dtype()), "'s ", esize, " bytes"));
  // product(shape) * esize, without overflow (BuildScoreJob bounds the
  // shape again, with its own messages).
  uint64_t want = esize;
  bool too_large = false;
  for (int64_t d : t.shape()) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative dimension in the shape"));
    if (d != 0 && want > (uint64_t{1} << 60) / static_cast<uint64_t>(d)) too_large = true;
    want *= static_cast<uint64_t>(d);
  }
  if (too_large || static_cast<uint64_t>(ref.byte_size()) != want)
    return absl::InvalidArgumentError(absl::StrCat(what, ".byte_size is ", ref.byte_size(), " but the shape of ",
                                                   DTypeName(t.dtype()), " needs ",
                                                   too_large ? std::string("more than 2^60") : absl::StrCat(want)));
  if (ref.allocation_bytes() > 0 &&
      (ref.offset() > ref.allocation_bytes() || ref.byte_size() > ref.allocation_bytes() - ref.offset()))
    return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", ref.offset(), ", ", ref.offset(), " + ",
                                                   ref.byte_size(), ") are outside the allocation of ",
                                                   ref.allocation_bytes(), " bytes (allocation_bytes)"));
  // A malformed reference is INVALID_ARGUMENT whatever the server; then
  // whether this server can serve it.
  LOGPROB_RETURN_IF_ERROR(CheckCudaIpcAvailable(availability, peer, payload));
  return std::shared_ptr<const InputSource>(
      std::make_shared<InClientGpu>(ref.handle(), ref.offset(), ref.byte_size(), ref.allocation_bytes()));
}

absl::Status CheckCudaIpcAvailable(const CudaIpcAvailability& a, const std::string& peer, const std::string& payload) {
  return WithReason(Unavailable(a, peer, payload), RulesOf(InputKind::kCudaIpc).unavailable);
}

}  // namespace logprob
