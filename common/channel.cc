#include "common/channel.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/metadata_channel.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

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

// 'text', as the Python client's messages quote values (%r).
std::string Quoted(absl::string_view text) { return absl::StrCat("'", text, "'"); }

}  // namespace

absl::StatusOr<std::string> CheckTarget(const std::string& given, const std::string& flag) {
  const std::string target(absl::StripAsciiWhitespace(given));
  if (target.empty())
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " must be 'HOST:PORT' (e.g. '127.0.0.1:50051'), got ", Quoted(given)));
  const std::string lower = absl::AsciiStrToLower(target);
  for (const char* scheme : {"dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:"})
    if (absl::StartsWith(lower, scheme)) return target;  // a gRPC resolver URI, passed on as is
  const std::string what = absl::StrCat(flag, " ", Quoted(target), ": ");
  if (const size_t sep = target.find("://"); sep != std::string::npos) {
    const std::string scheme = absl::AsciiStrToLower(target.substr(0, sep));
    absl::string_view rest = absl::string_view(target).substr(sep + 3);
    while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
    const char* tls =
        scheme == "https" || scheme == "grpcs" ? " (for TLS pass --tls-ca FILE, a URL scheme does not turn it on)" : "";
    return absl::InvalidArgumentError(absl::StrCat(what, "drop the scheme, give 'HOST:PORT' such as ",
                                                   Quoted(rest.empty() ? "127.0.0.1:50051" : rest), tls));
  }
  std::string host, port;
  if (target.front() == '[') {
    const size_t sep = target.find("]:");
    if (sep == std::string::npos) {
      absl::string_view open(target);
      while (!open.empty() && open.back() == ']') open.remove_suffix(1);
      return absl::InvalidArgumentError(
          absl::StrCat(what, "add the port, e.g. ", Quoted(absl::StrCat(open, "]:50051"))));
    }
    host = target.substr(0, sep);
    port = target.substr(sep + 2);
  } else {
    const size_t sep = target.rfind(':');
    if (sep == std::string::npos)
      return absl::InvalidArgumentError(
          absl::StrCat(what, "add the port, e.g. ", Quoted(absl::StrCat(target, ":50051"))));
    host = target.substr(0, sep);
    port = target.substr(sep + 1);
    if (host.find(':') != std::string::npos)
      return absl::InvalidArgumentError(
          absl::StrCat(what, "put an IPv6 address in brackets, e.g. ", Quoted(absl::StrCat("[", host, "]:", port))));
  }
  int number = 0;
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &number) || number < 1 || number > 65535)
    return absl::InvalidArgumentError(absl::StrCat(what, "the port must be a number in 1..65535, got ", Quoted(port)));
  if (host.find_first_not_of("[]") == std::string::npos)
    return absl::InvalidArgumentError(
        absl::StrCat(what, "add the host, e.g. ", Quoted(absl::StrCat("127.0.0.1:", port))));
  return target;
}

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
  const bool update = !options.update_token_file.empty();
  const std::string& token_file = update ? options.update_token_file : options.auth_token_file;
  if (token_file.empty()) return grpc::CreateCustomChannel(target, creds, args);

  const char* flag = update ? "--update-token-file" : "--auth-token-file";
  LOGPROB_ASSIGN_OR_RETURN(const std::string token, ReadFlagFile(flag, token_file));
  const std::string trimmed(absl::StripAsciiWhitespace(token));
  if (trimmed.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " ", token_file, ": the file is empty"));
  return ChannelWithMetadata(target, creds, args, "authorization", "Bearer " + trimmed);
}

}  // namespace logprob::client
