#include "worker/comm/control_store.h"

#include <grpcpp/grpcpp.h>

#include "gloo/common/error.h"

namespace logprob {

ControlStore::ControlStore(std::shared_ptr<internal::v1::Control::Stub> control, std::string prefix)
    : control_(std::move(control)), prefix_(std::move(prefix)) {}

void ControlStore::set(const std::string& key, const std::vector<char>& data) {
  internal::v1::StoreSetRequest req;
  req.set_key(prefix_ + key);
  req.set_value(std::string(data.begin(), data.end()));
  internal::v1::StoreSetReply rep;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const grpc::Status st = control_->StoreSet(&ctx, req, &rep);
  if (!st.ok()) throw gloo::IoException("store set " + key + ": " + st.error_message());
}

std::vector<std::string> ControlStore::Get(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  internal::v1::StoreGetRequest req;
  for (const auto& k : keys) req.add_keys(prefix_ + k);
  req.set_timeout_ms(timeout.count());
  internal::v1::StoreGetReply rep;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout + std::chrono::seconds(5));
  const grpc::Status st = control_->StoreGet(&ctx, req, &rep);
  if (!st.ok()) throw gloo::IoException("store get: " + st.error_message());
  return {rep.values().begin(), rep.values().end()};
}

std::vector<char> ControlStore::get(const std::string& key) {
  const auto v = Get({key}, kDefaultTimeout);
  return {v[0].begin(), v[0].end()};
}

void ControlStore::wait(const std::vector<std::string>& keys) { wait(keys, kDefaultTimeout); }

void ControlStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  Get(keys, timeout);
}

}  // namespace logprob
