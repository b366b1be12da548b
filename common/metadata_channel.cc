#include "common/metadata_channel.h"

#include <utility>
#include <vector>

#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_interceptor.h"

namespace logprob {
namespace {

/// Adds `key: value` to the initial metadata of one call.
class MetadataInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetadataInterceptor(const std::string& key, const std::string& value) : key_(key), value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA))
      methods->GetSendInitialMetadata()->emplace(key_, value_);
    methods->Proceed();
  }

 private:
  const std::string key_;
  const std::string value_;
};

class MetadataInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  MetadataInterceptorFactory(std::string key, std::string value) : key_(std::move(key)), value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new MetadataInterceptor(key_, value_);
  }

 private:
  const std::string key_;
  const std::string value_;
};

}  // namespace

std::shared_ptr<grpc::Channel> ChannelWithMetadata(const std::string& target,
                                                   const std::shared_ptr<grpc::ChannelCredentials>& creds,
                                                   const grpc::ChannelArguments& args, std::string key,
                                                   std::string value) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<MetadataInterceptorFactory>(std::move(key), std::move(value)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args, std::move(interceptors));
}

}  // namespace logprob
