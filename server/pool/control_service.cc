#include "server/pool/control_service.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/log_line.h"
#include "common/status_macros.h"

namespace logprob {

namespace {
constexpr absl::Duration kPoll = absl::Milliseconds(100);  // how often a Join call looks at its context

/// How a Join stream ends when its generation is over.
grpc::Status GenerationEnded(int64_t generation) {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      absl::StrCat("pool generation ", generation, " ended; join again"));
}
/// How a Join stream ends when the front-end stops.
grpc::Status ShuttingDown() { return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the front-end is shutting down"); }
}  // namespace

ControlService::ControlService(int world_size, internal::v1::JoinReply worker_config, LeaveCallback on_leave,
                               JoinObservers observers, uint32_t protocol_version, InternalAuth auth, std::string build)
    : world_size_(world_size),
      worker_config_(std::move(worker_config)),
      on_leave_(std::move(on_leave)),
      observers_(std::move(observers)),
      protocol_version_(protocol_version),
      build_(std::move(build)),
      auth_(std::move(auth)),
      addresses_(world_size) {}

void ControlService::WaitingChanged() {
  if (observers_.on_waiting) observers_.on_waiting(static_cast<int>(waiting_.size()));
}

void ControlService::AssignIfFull() {
  if (assigned_ || static_cast<int>(waiting_.size()) < world_size_) return;
  for (size_t r = 0; r < waiting_.size(); ++r) {
    waiting_[r]->rank = static_cast<int>(r);
    waiting_[r]->generation = generation_;
  }
  waiting_.clear();
  WaitingChanged();
  assigned_ = true;
  LogLine() << "logprob-server: " << world_size_ << " of " << world_size_ << " workers joined generation "
            << generation_ << "; ranks assigned in join order";
  cv_.SignalAll();
}

grpc::Status ControlService::WaitForRank(grpc::ServerContext* ctx, Joiner& me) {
  if (shutdown_) return ShuttingDown();
  if (assigned_ || static_cast<int>(waiting_.size()) >= world_size_) {
    if (observers_.on_refused) observers_.on_refused();
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("the pool already has its ", world_size_, " workers (generation ", generation_,
                                     "); join again when a worker leaves"));
  }
  waiting_.push_back(&me);
  WaitingChanged();
  LogLine() << "logprob-server: worker " << me.who << " joined (" << waiting_.size() << " of " << world_size_
            << " for generation " << generation_ << ")";
  AssignIfFull();
  // Wait for the rank; a joiner that goes away before gives up its place.
  while (me.rank < 0) {
    if (shutdown_ || ctx->IsCancelled()) {
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &me));
      WaitingChanged();
      if (shutdown_) return ShuttingDown();
      LogLine() << "logprob-server: worker " << me.who << " left before the pool formed";
      return grpc::Status(grpc::StatusCode::CANCELLED, "worker left");
    }
    cv_.WaitWithTimeout(&mu_, kPoll);
  }
  if (me.generation != generation_) return GenerationEnded(me.generation);  // reset since the assignment
  return grpc::Status::OK;
}

grpc::Status ControlService::Join(grpc::ServerContext* ctx, const internal::v1::JoinRequest* req,
                                  grpc::ServerWriter<internal::v1::JoinReply>* writer) {
  if (grpc::Status st = auth_.Check(*ctx, "Control.Join"); !st.ok()) return st;
  Joiner me;
  me.who = absl::StrCat(req->hostname(), " (pid ", req->pid(), ", peer ", ctx->peer(), ")");
  if (req->protocol_version() != protocol_version_) {
    const std::string why = ProtocolMismatch(req->protocol_version(), protocol_version_);
    LogLine() << "logprob-server: refused worker " << me.who << ": " << why;
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why);
  }
  if (req->build() != build_) {
    const std::string why = BuildMismatch(req->build(), build_);
    LogLine() << "logprob-server: refused worker " << me.who << ": " << why;
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, why);
  }
  internal::v1::JoinReply reply = worker_config_;
  reply.set_build(build_);
  {
    absl::MutexLock lock(&mu_);
    LOGPROB_RETURN_IF_ERROR(WaitForRank(ctx, me));
    reply.set_store_prefix(prefix_);
  }
  reply.set_rank(me.rank);
  reply.set_world_size(world_size_);
  if (reply.comm().empty()) reply.set_comm("gloo");
  if (reply.backend().empty()) reply.set_backend("cpu");
  reply.set_generation(me.generation);
  reply.set_protocol_version(protocol_version_);
  if (reply_hook_) reply_hook_(&reply);
  bool gone = !writer->Write(reply);
  {
    absl::MutexLock lock(&mu_);
    // A member until its generation ends or it goes away.
    while (!gone && me.generation == generation_ && !shutdown_) {
      gone = ctx->IsCancelled();
      if (!gone) cv_.WaitWithTimeout(&mu_, kPoll);
    }
    if (shutdown_) return ShuttingDown();
    if (me.generation != generation_) return GenerationEnded(me.generation);
  }
  const std::string why = absl::StrCat("worker rank ", me.rank, " ", me.who, " left the control plane");
  if (on_leave_) on_leave_(me.generation, me.rank, why);
  return grpc::Status(grpc::StatusCode::CANCELLED, "worker left");
}

grpc::Status ControlService::Ready(grpc::ServerContext* ctx, const internal::v1::ReadyRequest* req,
                                   internal::v1::ReadyReply*) {
  if (grpc::Status st = auth_.Check(*ctx, "Control.Ready"); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  if (req->store_prefix() != prefix_ || req->rank() < 0 || req->rank() >= world_size_)
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "not a rank of this pool generation");
  if (addresses_[req->rank()].empty()) ++ready_;
  addresses_[req->rank()] = req->worker_address();
  cv_.SignalAll();
  return grpc::Status::OK;
}

grpc::Status ControlService::StoreSet(grpc::ServerContext* ctx, const internal::v1::StoreSetRequest* req,
                                      internal::v1::StoreSetReply*) {
  if (grpc::Status st = auth_.Check(*ctx, "Control.StoreSet"); !st.ok()) return st;
  if (req->key().size() > kMaxStoreKeyBytes || req->value().size() > kMaxStoreValueBytes)
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("StoreSet: a key has at most ", kMaxStoreKeyBytes, " bytes and a value at most ",
                     kMaxStoreValueBytes, " (got ", req->key().size(), " and ", req->value().size(), ")"));
  absl::MutexLock lock(&mu_);
  if (req->key().compare(0, prefix_.size(), prefix_) != 0)
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "StoreSet: the key is not of this pool generation's store");
  const auto old = store_.find(req->key());
  const size_t before = old == store_.end() ? 0 : old->first.size() + old->second.size();
  const size_t after = req->key().size() + req->value().size();
  if (store_bytes_ - before + after > kMaxStoreBytes)
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("StoreSet: the store holds at most ", kMaxStoreBytes, " bytes"));
  store_bytes_ = store_bytes_ - before + after;
  store_[req->key()] = req->value();
  cv_.SignalAll();
  return grpc::Status::OK;
}

bool ControlService::HasKeys(const internal::v1::StoreGetRequest& req) {
  for (const auto& k : req.keys())
    if (!store_.count(k)) return false;
  return true;
}

grpc::Status ControlService::StoreGet(grpc::ServerContext* ctx, const internal::v1::StoreGetRequest* req,
                                      internal::v1::StoreGetReply* reply) {
  if (grpc::Status st = auth_.Check(*ctx, "Control.StoreGet"); !st.ok()) return st;
  if (req->keys_size() > kMaxStoreGetKeys)
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("StoreGet: at most ", kMaxStoreGetKeys, " keys per call"));
  absl::MutexLock lock(&mu_);
  // At most ten minutes, however long the caller asks for.
  const absl::Time deadline = absl::Now() + std::min(absl::Milliseconds(req->timeout_ms()), absl::Minutes(10));
  while (!HasKeys(*req)) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "store get cancelled");
    if (absl::Now() >= deadline)
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "store keys did not appear in time");
    cv_.WaitWithDeadline(&mu_, std::min(deadline, absl::Now() + absl::Milliseconds(200)));
  }
  for (const auto& k : req->keys()) reply->add_values(store_[k]);
  return grpc::Status::OK;
}

absl::StatusOr<std::vector<std::string>> ControlService::WaitAllReady(std::chrono::milliseconds timeout) {
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  while (ready_ != world_size_ && !cv_.WaitWithDeadline(&mu_, deadline)) {
  }
  if (ready_ != world_size_)
    return absl::DeadlineExceededError(absl::StrCat(ready_, " of ", world_size_, " workers became ready in time"));
  return addresses_;
}

void ControlService::Reset(int64_t generation) {
  absl::MutexLock lock(&mu_);
  generation_ = generation;
  prefix_ = absl::StrCat("gen", generation, "/");
  assigned_ = false;
  ready_ = 0;
  addresses_.assign(world_size_, "");
  store_.clear();
  store_bytes_ = 0;
  AssignIfFull();
  cv_.SignalAll();
}

void ControlService::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  cv_.SignalAll();
}

grpc::Status ControlService::CheckMember(int64_t generation) {
  absl::MutexLock lock(&mu_);
  if (generation == generation_ && !shutdown_) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::FAILED_PRECONDITION,
      absl::StrCat("not a member of the current pool generation (", generation_, "; the call says ", generation, ")"));
}

bool ControlService::all_joined() {
  absl::MutexLock lock(&mu_);
  return assigned_;
}

int ControlService::ready_count() {
  absl::MutexLock lock(&mu_);
  return ready_;
}

}  // namespace logprob
