#include "client/shm_inputs.h"

#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/random_id.h"
#include "common/shared_memory.h"

namespace logprob::client {
namespace {

void Deadline(grpc::ClientContext* context, double seconds) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(seconds > 0 ? seconds : 60.0)));
}

}  // namespace

ShmInputs::ShmInputs(v1::LogprobService::StubInterface& stub, double timeout_seconds)
    : stub_(stub), timeout_seconds_(timeout_seconds), session_(RandomId(16)) {}

ShmInputs::~ShmInputs() { Release(); }

void ShmInputs::Attach(grpc::ClientContext* context) const { context->AddMetadata(kShmSessionMetadata, session_); }

void ShmInputs::Release() {
  if (!region_.empty()) {
    grpc::ClientContext context;
    Deadline(&context, timeout_seconds_);
    Attach(&context);
    v1::UnregisterSharedMemoryRequest req;
    req.set_name(region_);
    v1::UnregisterSharedMemoryResponse resp;
    stub_.UnregisterSharedMemory(&context, req, &resp);  // best effort: expires otherwise
    region_.clear();
  }
  shm_.reset();  // unmaps and unlinks
  size_ = 0;
}

absl::Status ShmInputs::Grow(size_t bytes) {
  Release();
  size_t size = size_t{1} << 20;
  while (size < bytes) size *= 2;
  const std::string name = absl::StrCat("/logprob-client-", getpid(), "-", RandomId(8));
  // The object's last kShmProofBytes, past the usable bytes, take the
  // registration's challenge (the proof of write access).
  auto created = SharedRegion::Create(size + kShmProofBytes, name);
  if (!created.ok()) return created.status();
  shm_ = *std::move(created);
  size_ = size;
  v1::RegisterSharedMemoryRequest req;
  req.set_name(absl::StrCat("inputs-", RandomId(4)));
  req.set_shm_name(name);
  req.set_byte_size(static_cast<int64_t>(size));
  v1::RegisterSharedMemoryResponse resp;
  {
    grpc::ClientContext context;
    Deadline(&context, timeout_seconds_);
    Attach(&context);
    const grpc::Status s = stub_.RegisterSharedMemory(&context, req, &resp);
    if (!s.ok()) {
      Release();
      return FromGrpc(s);
    }
  }
  region_ = req.name();
  if (resp.challenge().empty()) return absl::OkStatus();  // a server that asks for no proof
  const int64_t at = resp.proof_offset();
  if (static_cast<int64_t>(resp.challenge().size()) != kShmProofBytes || at < static_cast<int64_t>(size) ||
      at > static_cast<int64_t>(shm_->size()) - kShmProofBytes) {
    Release();
    return absl::InternalError(absl::StrCat("RegisterSharedMemory answered a challenge of ", resp.challenge().size(),
                                            " bytes at offset ", at, " of a ", shm_->size(), "-byte object"));
  }
  std::memcpy(shm_->data() + at, resp.challenge().data(), resp.challenge().size());
  grpc::ClientContext context;
  Deadline(&context, timeout_seconds_);
  Attach(&context);
  v1::ConfirmSharedMemoryRequest confirm;
  confirm.set_name(region_);
  v1::ConfirmSharedMemoryResponse confirmed;
  if (const grpc::Status s = stub_.ConfirmSharedMemory(&context, confirm, &confirmed); !s.ok()) {
    Release();
    return FromGrpc(s);
  }
  return absl::OkStatus();
}

absl::Status ShmInputs::Place(v1::ScoreRequest* request) {
  auto aligned = [](size_t n) { return (n + 63) & ~size_t{63}; };
  size_t total = 0;
  for (const v1::Tensor& t : request->inputs()) total += aligned(t.data().size());
  if (total > size_ || region_.empty())
    if (absl::Status st = Grow(total); !st.ok()) return st;
  size_t at = 0;
  for (v1::Tensor& t : *request->mutable_inputs()) {
    if (t.has_shared_memory()) continue;
    const size_t n = t.data().size();
    std::memcpy(shm_->data() + at, t.data().data(), n);
    v1::SharedMemoryRef* ref = t.mutable_shared_memory();  // replaces (frees) data: Tensor.source is a oneof
    ref->set_region(region_);
    ref->set_offset(static_cast<int64_t>(at));
    ref->set_byte_size(static_cast<int64_t>(n));
    at += aligned(n);
  }
  return absl::OkStatus();
}

bool SameSharedMemoryHost(const v1::ServerInfo& info) {
  return info.shared_memory_inputs() && !info.host_id().empty() && info.host_id() == SharedMemoryHostId();
}

}  // namespace logprob::client
