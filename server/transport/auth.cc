#include "server/transport/auth.h"

#include <openssl/crypto.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/sha256.h"

namespace logprob {
namespace {

constexpr char kScheme[] = "bearer ";  // compared case-insensitively

absl::Status CheckTokenChars(const std::string& token) {
  if (token.empty()) return absl::InvalidArgumentError("the token is empty");
  for (const char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          "the token holds a character that is not printable ASCII (or a space inside it)");
    }
  }
  return absl::OkStatus();
}

}  // namespace

BearerTokenAuth::BearerTokenAuth(const std::string& token) : digest_(Sha256(token)) {}

absl::StatusOr<BearerTokenAuth> BearerTokenAuth::FromToken(const std::string& token) {
  const std::string trimmed(absl::StripAsciiWhitespace(token));
  if (absl::Status s = CheckTokenChars(trimmed); !s.ok()) return s;
  return BearerTokenAuth(trimmed);
}

absl::StatusOr<BearerTokenAuth> BearerTokenAuth::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read: ", std::strerror(errno)));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read"));
  auto auth = FromToken(buf.str());
  if (!auth.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", auth.status().message()));
  return auth;
}

bool BearerTokenAuth::PresentedBy(const grpc::ServerContext& context) const {
  const auto range = context.client_metadata().equal_range("authorization");
  bool ok = false;
  for (auto it = range.first; it != range.second; ++it) {
    const absl::string_view value(it->second.data(), it->second.size());
    if (value.size() < sizeof kScheme - 1 || !absl::EqualsIgnoreCase(value.substr(0, sizeof kScheme - 1), kScheme)) {
      continue;
    }
    const absl::string_view presented = value.substr(sizeof kScheme - 1);
    const auto d = Sha256(std::string_view(presented.data(), presented.size()));
    ok |= CRYPTO_memcmp(d.data(), digest_.data(), d.size()) == 0;
  }
  return ok;
}

grpc::Status BearerTokenAuth::Check(const grpc::ServerContext& context) const {
  if (PresentedBy(context)) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
}

bool BearerTokenAuth::SameTokenAs(const BearerTokenAuth& other) const {
  return CRYPTO_memcmp(digest_.data(), other.digest_.data(), digest_.size()) == 0;
}

grpc::Status AccessPolicy::Check(const grpc::ServerContext& context, Right right, const char* method) const {
  const bool by_update = update_ != nullptr && update_->PresentedBy(context);
  if (right == Right::kScore) {
    if (scoring_ == nullptr || by_update || scoring_->PresentedBy(context)) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
  }
  if (update_ == nullptr) return scoring_ == nullptr ? grpc::Status::OK : scoring_->Check(context);
  if (by_update) return grpc::Status::OK;
  if (scoring_ != nullptr && scoring_->PresentedBy(context)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(method,
                                     " needs the update right: this bearer token may only score (send the token of "
                                     "the server's --update-token-file)"));
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      absl::StrCat("missing or invalid bearer token (", method,
                                   " needs the update right: the token of the server's --update-token-file)"));
}

}  // namespace logprob
