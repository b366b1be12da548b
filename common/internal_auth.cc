#include "common/internal_auth.h"

#include <openssl/crypto.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/log_line.h"
#include "common/metadata_channel.h"
#include "common/sha256.h"
#include "common/untrusted_text.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace logprob {
namespace {
std::atomic<int64_t> g_refused{0};
}  // namespace

InternalAuth::InternalAuth(const PoolSecret& secret) : secret_(secret.value()), digest_(Sha256(secret.value())) {}

grpc::Status InternalAuth::Check(const grpc::ServerContext& context, const char* method) const {
  if (!secret_) return grpc::Status::OK;
  const auto range = context.client_metadata().equal_range(kPoolSecretMetadataKey);
  bool ok = false;
  for (auto it = range.first; it != range.second; ++it) {
    const auto d = Sha256(std::string_view(it->second.data(), it->second.size()));
    ok |= CRYPTO_memcmp(d.data(), digest_.data(), d.size()) == 0;
  }
  if (ok) return grpc::Status::OK;
  const int64_t n = g_refused.fetch_add(1) + 1;
  if (n == 1 || n % 1000 == 0)
    LogLine() << "logprob: refused internal call " << method << " from " << Printable(context.peer())
              << ": missing or wrong pool secret (" << n << " refused so far)";
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      absl::StrCat(method,
                                   ": missing or wrong pool secret; the internal plane serves only the pool's own "
                                   "processes (a worker needs the front-end's --internal-secret-file; a worker of a "
                                   "release before worker protocol version 10 sends none)"));
}

std::shared_ptr<grpc::Channel> InternalAuth::Channel(const std::string& target,
                                                     const grpc::ChannelArguments& args) const {
  if (!secret_) return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  return ChannelWithMetadata(target, grpc::InsecureChannelCredentials(), args, kPoolSecretMetadataKey, *secret_);
}

int64_t InternalAuth::refused() { return g_refused.load(); }

}  // namespace logprob
