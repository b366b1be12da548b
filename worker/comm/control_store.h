// A Gloo rendezvous store backed by the front-end's Control service, so
// workers bootstrap their communicator without a shared filesystem (and
// the same way in one box or in a Kubernetes StatefulSet).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gloo/rendezvous/store.h"
#include "logprob/internal/v1/worker.grpc.pb.h"

namespace logprob {

/// gloo::rendezvous::Store over Control.StoreSet / StoreGet. Keys are
/// prefixed with the communicator generation's prefix. Failures throw
/// gloo::IoException, as Gloo's own stores do.
class ControlStore final : public gloo::rendezvous::Store {
 public:
  ControlStore(std::shared_ptr<internal::v1::Control::Stub> control, std::string prefix);
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  std::vector<std::string> Get(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  std::shared_ptr<internal::v1::Control::Stub> control_;
  std::string prefix_;
};

}  // namespace logprob
