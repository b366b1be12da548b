#include "worker/cuda/nccl_communicator.h"

#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/cuda/cuda_error.h"
#include "worker/cuda/nccl_poll.h"
#include "worker/scoring/one_pass_layout.h"

namespace logprob::cuda {
namespace {

constexpr char kUniqueIdKey[] = "nccl_unique_id";

std::string NcclError(ncclResult_t r) { return absl::StrCat(ncclGetErrorString(r), ": ", ncclGetLastError(nullptr)); }

}  // namespace

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(gloo::rendezvous::Store& store, int rank,
                                                                           int size, int device, cudaStream_t stream,
                                                                           std::chrono::milliseconds timeout) {
  ncclUniqueId id;
  try {
    if (rank == 0) {
      if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
        return absl::UnavailableError(absl::StrCat("ncclGetUniqueId: ", NcclError(r)));
      store.set(kUniqueIdKey, std::vector<char>(id.internal, id.internal + sizeof id.internal));
    } else {
      store.wait({kUniqueIdKey}, timeout);
      const std::vector<char> v = store.get(kUniqueIdKey);
      if (v.size() != sizeof id.internal)
        return absl::UnavailableError(
            absl::StrCat("NCCL unique id in the store has ", v.size(), " bytes, expected ", sizeof id.internal));
      std::memcpy(id.internal, v.data(), v.size());
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("NCCL bootstrap through the front-end store failed for rank ", rank, ": ", e.what()));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->rank_ = rank;
  c->size_ = size;
  c->device_ = device;
  c->timeout_ = timeout;
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  if (!stream) {
    LOGPROB_RETURN_IF_ERROR(c->own_stream_.Create());
    stream = c->own_stream_.get();
  }
  c->stream_ = stream;
  LOGPROB_RETURN_IF_ERROR(c->done_.Create());
  // Non-blocking, so that a peer that never joins (a worker that died
  // after the rendezvous) cannot hang this one: ready within `timeout`, or
  // aborted (issue 50).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm_, size, id, rank, &config);
  if (r == ncclSuccess || r == ncclInProgress) r = c->WaitReady(deadline);
  if (r != ncclSuccess) {
    const std::string where =
        absl::StrCat("ncclCommInitRankConfig (rank ", rank, " of ", size, ", device ", device, ")");
    if (c->comm_) ncclCommAbort(c->comm_);
    c->comm_ = nullptr;
    if (r == ncclInProgress)
      return absl::DeadlineExceededError(absl::StrCat(where, " did not finish within ", timeout.count(),
                                                      " ms (a peer that never joined?); communicator aborted"));
    return absl::UnavailableError(absl::StrCat(where, ": ", NcclError(r)));
  }
  return c;
}

ncclResult_t NcclCommunicator::WaitReady(std::chrono::steady_clock::time_point deadline) {
  return PollNccl(
      [this] {
        ncclResult_t async = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
        return r != ncclSuccess ? r : async;
      },
      deadline);
}

NcclCommunicator::~NcclCommunicator() {
  if (!comm_) return;
  ClearedError(cudaSetDevice(device_));
  // Non-blocking: finalised (flushing what is queued) within the timeout,
  // then destroyed; aborted when that fails or does not finish.
  if (!broken_) {
    ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) r = WaitReady(std::chrono::steady_clock::now() + timeout_);
    if (r == ncclSuccess) {
      ncclCommDestroy(comm_);  // frees it whatever it answers: never aborted after
      return;
    }
  }
  ncclCommAbort(comm_);
}

absl::Status NcclCommunicator::Abort(absl::Status why) {
  if (comm_ && !broken_) ncclCommAbort(comm_);
  comm_ = nullptr;
  broken_ = true;
  return why;
}

absl::Status NcclCommunicator::Usable() {
  if (broken_) return absl::UnavailableError("NCCL communicator was aborted after an earlier failure");
  LOGPROB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Begin(const void* in, size_t in_bytes, size_t out_bytes) {
  LOGPROB_RETURN_IF_ERROR(Usable());
  LOGPROB_RETURN_IF_ERROR(in_dev_.Reserve(std::max<size_t>(in_bytes, 1)));
  LOGPROB_RETURN_IF_ERROR(out_dev_.Reserve(std::max<size_t>(out_bytes, 1)));
  LOGPROB_RETURN_IF_ERROR(out_host_.Reserve(std::max<size_t>(out_bytes, 1)));
  if (in_bytes)
    LOGPROB_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(in_dev_.get(), in, in_bytes, cudaMemcpyHostToDevice, stream_),
                                 "collective upload");
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Finish(const char* what, ncclResult_t enqueued, void* out, size_t out_bytes) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  // A non-blocking communicator may still be enqueueing: the event below
  // must come after the collective on the stream.
  if (enqueued == ncclInProgress) enqueued = WaitReady(deadline);
  if (enqueued == ncclInProgress)
    return Abort(absl::DeadlineExceededError(
        absl::StrCat("NCCL ", what, " was not enqueued within ", timeout_.count(), " ms; communicator aborted")));
  if (enqueued != ncclSuccess)
    return Abort(absl::UnavailableError(absl::StrCat("NCCL ", what, ": ", NcclError(enqueued))));
  // Download into pinned memory (asynchronous, so the polling below can time
  // out and abort); copied to `out` once the event completed.
  if (out_bytes)
    if (cudaError_t e = cudaMemcpyAsync(out_host_.get(), out_dev_.get(), out_bytes, cudaMemcpyDeviceToHost, stream_);
        e != cudaSuccess)
      return Abort(CudaStatus(e, "collective download"));
  if (cudaError_t e = cudaEventRecord(done_.get(), stream_); e != cudaSuccess) return Abort(CudaStatus(e, "event"));
  for (;;) {
    // cudaErrorNotReady is recorded as the thread's last error too: cleared,
    // or the next kernel launch would report it as its own failure.
    const cudaError_t e = ClearedError(cudaEventQuery(done_.get()));
    if (e == cudaSuccess) {
      if (out_bytes) std::memcpy(out, out_host_.get(), out_bytes);
      return absl::OkStatus();
    }
    if (e != cudaErrorNotReady) {
      // Through CudaStatus: a sticky fault first seen here sets
      // StickyErrorSeen, so the worker leaves the pool (issue 50); any
      // other error is UNAVAILABLE too (the communicator is aborted).
      absl::Status st = CudaStatus(e, absl::StrCat("NCCL ", what).c_str());
      if (!absl::IsUnavailable(st)) st = absl::UnavailableError(st.message());
      return Abort(st);
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress)
      return Abort(absl::UnavailableError(absl::StrCat("NCCL ", what, " (peer failure?): ", NcclError(async))));
    if (std::chrono::steady_clock::now() > deadline)
      return Abort(absl::DeadlineExceededError(
          absl::StrCat("NCCL ", what, " did not finish within ", timeout_.count(), " ms; communicator aborted")));
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

absl::Status NcclCommunicator::AllGather(const void* in, size_t bytes, void* out) {
  const size_t out_bytes = bytes * static_cast<size_t>(size_);
  LOGPROB_RETURN_IF_ERROR(Begin(in, bytes, out_bytes));
  const ncclResult_t r = ncclAllGather(in_dev_.get(), out_dev_.get(), bytes, ncclChar, comm_, stream_);
  return Finish("all-gather", r, out, out_bytes);
}

ncclResult_t NcclCommunicator::EnqueueAllToAllV(const char* in, const std::vector<int64_t>& send_bytes, char* out,
                                                const std::vector<int64_t>& recv_bytes) {
  // Blocks consecutive in rank order (worker/scoring/one_pass_layout.h).
  const std::vector<int64_t> send_off = Displacements(send_bytes), recv_off = Displacements(recv_bytes);
  ncclResult_t r = ncclGroupStart();
  // ncclInProgress (a non-blocking communicator) is no failure: Finish waits.
  auto fine = [](ncclResult_t x) { return x == ncclSuccess || x == ncclInProgress; };
  for (int q = 0; q < size_ && fine(r); ++q) {
    if (send_bytes[q] > 0)
      r = ncclSend(in + send_off[q], static_cast<size_t>(send_bytes[q]), ncclChar, q, comm_, stream_);
    if (fine(r) && recv_bytes[q] > 0)
      r = ncclRecv(out + recv_off[q], static_cast<size_t>(recv_bytes[q]), ncclChar, q, comm_, stream_);
  }
  const ncclResult_t end = ncclGroupEnd();
  return fine(r) ? end : r;
}

absl::Status NcclCommunicator::AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                         const std::vector<int64_t>& recv_bytes) {
  if (static_cast<int>(send_bytes.size()) != size_ || static_cast<int>(recv_bytes.size()) != size_)
    return absl::InvalidArgumentError("AllToAllV needs one send and one receive size per rank");
  size_t in_total = 0, out_total = 0;
  for (int q = 0; q < size_; ++q) {
    in_total += static_cast<size_t>(send_bytes[q]);
    out_total += static_cast<size_t>(recv_bytes[q]);
  }
  LOGPROB_RETURN_IF_ERROR(Begin(in, in_total, out_total));
  return Finish("all-to-all", EnqueueAllToAllV(in_dev_.get<char>(), send_bytes, out_dev_.get<char>(), recv_bytes), out,
                out_total);
}

absl::Status NcclCommunicator::AllGatherDevice(const void* in, size_t bytes, void* out) {
  LOGPROB_RETURN_IF_ERROR(Usable());
  const ncclResult_t r = ncclAllGather(in, out, bytes, ncclChar, comm_, stream_);
  return Finish("all-gather (device buffers)", r, nullptr, 0);
}

absl::Status NcclCommunicator::AllToAllVDevice(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                               const std::vector<int64_t>& recv_bytes) {
  if (static_cast<int>(send_bytes.size()) != size_ || static_cast<int>(recv_bytes.size()) != size_)
    return absl::InvalidArgumentError("AllToAllVDevice needs one send and one receive size per rank");
  LOGPROB_RETURN_IF_ERROR(Usable());
  return Finish("all-to-all (device buffers)",
                EnqueueAllToAllV(static_cast<const char*>(in), send_bytes, static_cast<char*>(out), recv_bytes),
                nullptr, 0);
}

}  // namespace logprob::cuda
