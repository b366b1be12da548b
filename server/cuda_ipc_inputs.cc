#include "server/cuda_ipc_inputs.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "server/shm_session.h"

namespace logprob {
namespace {

/// The fake address of CudaIpcPlaceholder: page-aligned, never mapped by
/// anything that reads it (rows of a CUDA IPC job are never dereferenced).
const char* PlaceholderBase() { return reinterpret_cast<const char*>(uintptr_t{1} << 20); }

constexpr char kInstead[] = "; send the hidden states as bytes (inline or through shared memory) instead";

}  // namespace

absl::StatusOr<std::optional<CudaIpcInput>> FindCudaIpcInput(const v1::ScoreRequest& req) {
  std::optional<CudaIpcInput> found;
  for (int i = 0; i < req.inputs_size(); ++i) {
    const v1::Tensor& t = req.inputs(i);
    if (!t.has_cuda_ipc()) continue;
    const std::string what = absl::StrCat("inputs[", i, "] \"", t.name(), "\": cuda_ipc");
    if (t.name() != "hidden_states")
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is only accepted for \"hidden_states\"; send this tensor's bytes"));
    if (found) return absl::InvalidArgumentError(absl::StrCat(what, ": tensor \"hidden_states\" given twice"));
    if (!t.data().empty())
      return absl::InvalidArgumentError(absl::StrCat(what, " given together with data; send one of them"));
    if (t.has_shared_memory())
      return absl::InvalidArgumentError(absl::StrCat(what, " given together with shared_memory; send one of them"));
    const v1::CudaIpcRef& ref = t.cuda_ipc();
    if (ref.handle().size() != kCudaIpcHandleBytes)
      return absl::InvalidArgumentError(absl::StrCat(what, ".handle is ", ref.handle().size(),
                                                     " bytes; a cudaIpcMemHandle_t is ", kCudaIpcHandleBytes));
    if (ref.offset() < 0 || ref.byte_size() < 0)
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": offset ", ref.offset(), " and byte_size ", ref.byte_size(), " must be >= 0"));
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
    found = CudaIpcInput{i, ref.handle(), ref.offset(), ref.byte_size(), ref.device_uuid()};
  }
  return found;
}

absl::Status CheckCudaIpcAvailable(const CudaIpcAvailability& a, const std::string& peer) {
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
        "CUDA IPC inputs need one worker or --comm nccl (the workers read the client's GPU memory in one pass "
        "over device collectives); this server has ",
        a.workers, " workers over ", a.comm, kInstead));
  if (!IsLocalPeer(peer))
    return absl::FailedPreconditionError(absl::StrCat("CUDA IPC inputs are for clients on the server's host; peer \"",
                                                      peer, "\" is not local", kInstead));
  return absl::OkStatus();
}

absl::Status CheckCudaIpcOptions(const v1::ScoreOptions& options) {
  if (options.sampling_top_k() > 0 || (options.has_sampling_top_p() && options.sampling_top_p() < 1.0f))
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC input with options.sampling_top_k / options.sampling_top_p: sampling filters score "
                     "hidden states in rounds through host memory",
                     kInstead));
  return absl::OkStatus();
}

std::string_view CudaIpcPlaceholder(int64_t byte_size) {
  return std::string_view(PlaceholderBase(), static_cast<size_t>(byte_size));
}

void ExpandToInputRows(const CudaIpcInput& input, ScoreJob* job) {
  const int64_t n = job->row_bytes == 0 ? 0 : input.byte_size / static_cast<int64_t>(job->row_bytes);
  const int k = job->gather_k;
  std::vector<const char*> rows(static_cast<size_t>(n));
  std::vector<int64_t> targets(static_cast<size_t>(n), -1), out_pos(static_cast<size_t>(n), -1);
  std::vector<int64_t> gather_ids(static_cast<size_t>(n) * k, 0);
  for (int64_t r = 0; r < n; ++r) rows[r] = PlaceholderBase() + r * job->row_bytes;
  for (int64_t j = 0; j < job->num_rows(); ++j) {
    const int64_t r = (job->rows[j] - PlaceholderBase()) / static_cast<int64_t>(job->row_bytes);
    targets[r] = job->targets[j];
    out_pos[r] = job->out_pos[j];
    std::copy_n(job->gather_ids.begin() + j * k, k, gather_ids.begin() + r * k);
  }
  job->rows = std::move(rows);
  job->targets = std::move(targets);
  job->out_pos = std::move(out_pos);
  job->gather_ids = std::move(gather_ids);
  job->cuda_ipc = ScoreJob::CudaIpc{input.handle, input.offset, input.device_uuid};
}

}  // namespace logprob
