#include "server/control_service.h"

#include "absl/strings/str_cat.h"

namespace logprob {

ControlService::ControlService(int world_size, std::string store_prefix, internal::v1::JoinReply worker_config)
    : world_size_(world_size), prefix_(std::move(store_prefix)), worker_config_(std::move(worker_config)),
      addresses_(world_size) {}

grpc::Status ControlService::Join(grpc::ServerContext*, const internal::v1::JoinRequest*,
                                  internal::v1::JoinReply* reply) {
  std::lock_guard<std::mutex> lock(mu_);
  if (next_rank_ >= world_size_)
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StrCat("the pool already has its ", world_size_, " workers"));
  *reply = worker_config_;
  reply->set_rank(next_rank_++);
  reply->set_world_size(world_size_);
  if (reply->comm().empty()) reply->set_comm("gloo");
  if (reply->backend().empty()) reply->set_backend("cpu");
  reply->set_store_prefix(prefix_);
  return grpc::Status::OK;
}

grpc::Status ControlService::Ready(grpc::ServerContext*, const internal::v1::ReadyRequest* req,
                                   internal::v1::ReadyReply*) {
  std::lock_guard<std::mutex> lock(mu_);
  if (req->store_prefix() != prefix_ || req->rank() < 0 || req->rank() >= world_size_)
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "not a rank of this pool generation");
  if (addresses_[req->rank()].empty()) ++ready_;
  addresses_[req->rank()] = req->worker_address();
  cv_.notify_all();
  return grpc::Status::OK;
}

grpc::Status ControlService::StoreSet(grpc::ServerContext*, const internal::v1::StoreSetRequest* req,
                                      internal::v1::StoreSetReply*) {
  std::lock_guard<std::mutex> lock(mu_);
  store_[req->key()] = req->value();
  cv_.notify_all();
  return grpc::Status::OK;
}

grpc::Status ControlService::StoreGet(grpc::ServerContext* ctx, const internal::v1::StoreGetRequest* req,
                                      internal::v1::StoreGetReply* reply) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(req->timeout_ms());
  auto all_there = [&] {
    for (const auto& k : req->keys())
      if (!store_.count(k)) return false;
    return true;
  };
  while (!all_there()) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "store get cancelled");
    if (cv_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(200))) ==
            std::cv_status::timeout &&
        std::chrono::steady_clock::now() >= deadline)
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "store keys did not appear in time");
  }
  for (const auto& k : req->keys()) reply->add_values(store_[k]);
  return grpc::Status::OK;
}

absl::StatusOr<std::vector<std::string>> ControlService::WaitAllReady(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return ready_ == world_size_; }))
    return absl::DeadlineExceededError(absl::StrCat(ready_, " of ", world_size_, " workers became ready in time"));
  return addresses_;
}

void ControlService::Reset(std::string store_prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  prefix_ = std::move(store_prefix);
  next_rank_ = 0;
  ready_ = 0;
  addresses_.assign(world_size_, "");
  store_.clear();
}

int ControlService::ready_count() {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

}  // namespace logprob
