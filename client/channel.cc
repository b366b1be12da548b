#include "client/channel.h"

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_interceptor.h"

namespace logprob::client {
namespace {

grpc::ChannelArguments DefaultArgs() {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(INT_MAX);
  args.SetMaxReceiveMessageSize(INT_MAX);
  // Quick reconnects after a server restart. Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS:
  // gRPC also takes it as the connect timeout, which cut TLS handshakes
  // short on a loaded machine ("tcp handshaker shutdown").
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  return args;
}

// The contents of `file`, named by `flag`; INVALID_ARGUMENT when unreadable or empty.
absl::StatusOr<std::string> ReadFlagFile(const char* flag, const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, " ", file, ": cannot read: ", std::strerror(errno)));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(flag, " ", file, ": cannot read"));
  if (buf.str().empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " ", file, ": the file is empty"));
  return buf.str();
}

// Adds "authorization: <value>" to the initial metadata of every call.
class AuthInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit AuthInterceptor(std::string value) : value_(std::move(value)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", value_);
    }
    methods->Proceed();
  }

 private:
  const std::string value_;
};

class AuthInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit AuthInterceptorFactory(std::string token) : value_("Bearer " + std::move(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new AuthInterceptor(value_);
  }

 private:
  const std::string value_;
};

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target) {
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), DefaultArgs());
}

bool UsesTls(const ChannelOptions& o) {
  return !o.tls_ca.empty() || !o.tls_cert.empty() || !o.tls_key.empty() || !o.tls_server_name.empty();
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& target, const ChannelOptions& options) {
  grpc::ChannelArguments args = DefaultArgs();
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (UsesTls(options)) {
    if (options.tls_cert.empty() != options.tls_key.empty()) {
      return absl::InvalidArgumentError(options.tls_key.empty()
                                            ? absl::StrCat("--tls-cert ", options.tls_cert, " needs --tls-key")
                                            : absl::StrCat("--tls-key ", options.tls_key, " needs --tls-cert"));
    }
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca.empty()) {
      LOGPROB_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFlagFile("--tls-ca", options.tls_ca));
    }
    if (!options.tls_cert.empty()) {
      LOGPROB_ASSIGN_OR_RETURN(std::string cert, ReadFlagFile("--tls-cert", options.tls_cert));
      LOGPROB_ASSIGN_OR_RETURN(std::string key, ReadFlagFile("--tls-key", options.tls_key));
      ssl.pem_cert_chain = std::move(cert);
      ssl.pem_private_key = std::move(key);
    }
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
    creds = grpc::SslCredentials(ssl);
    if (!creds)
      return absl::InvalidArgumentError("gRPC could not build TLS credentials from --tls-ca/--tls-cert/--tls-key");
  }
  if (options.auth_token_file.empty()) return grpc::CreateCustomChannel(target, creds, args);

  LOGPROB_ASSIGN_OR_RETURN(const std::string token, ReadFlagFile("--auth-token-file", options.auth_token_file));
  const std::string trimmed(absl::StripAsciiWhitespace(token));
  if (trimmed.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-token-file ", options.auth_token_file, ": the file is empty"));
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<AuthInterceptorFactory>(trimmed));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args, std::move(interceptors));
}

}  // namespace logprob::client
