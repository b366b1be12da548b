#include "worker/comm/gloo_communicator.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "gloo/allgather.h"
#include "gloo/alltoallv.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"

namespace logprob {

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(gloo::rendezvous::Store& store,
                                                                           const std::string& hostname, int rank,
                                                                           int size,
                                                                           std::chrono::milliseconds timeout) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(timeout);
    ctx->connectFullMesh(store, device);
    return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(std::move(ctx)));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo rendezvous failed for rank ", rank, ": ", e.what()));
  }
}

int GlooCommunicator::rank() const { return ctx_->rank; }
int GlooCommunicator::size() const { return ctx_->size; }

absl::Status GlooCommunicator::AllGather(const void* in, size_t bytes, void* out) {
  try {
    gloo::AllgatherOptions opts(ctx_);
    opts.setInput(const_cast<char*>(static_cast<const char*>(in)), bytes);
    opts.setOutput(static_cast<char*>(out), bytes * static_cast<size_t>(ctx_->size));
    opts.setTag(next_tag_++);
    gloo::allgather(opts);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("all-gather failed: ", e.what()));
  }
}

absl::Status GlooCommunicator::AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                         const std::vector<int64_t>& recv_bytes) {
  try {
    gloo::AlltoallvOptions opts(ctx_);
    opts.setInput(const_cast<char*>(static_cast<const char*>(in)), send_bytes);
    opts.setOutput(static_cast<char*>(out), recv_bytes);
    opts.setTag(next_tag_++);
    gloo::alltoallv(opts);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("all-to-all failed: ", e.what()));
  }
}

}  // namespace logprob
