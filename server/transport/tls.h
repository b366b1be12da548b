// TLS and mutual-TLS credentials of the public port.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"

namespace logprob {

/// The credentials of the public listening port from the PEM files named by
/// `--tls-cert` (certificate chain, leaf first), `--tls-key` (its private
/// key) and `--tls-client-ca` (CA certificates that client certificates
/// must chain to). All three empty: InsecureServerCredentials. Cert and
/// key: grpc::SslServerCredentials without client certificates. With a
/// client CA as well: mutual TLS, every client must present a certificate
/// signed by that CA (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY).
///
/// Errors (INVALID_ARGUMENT, the message names the flag and the file):
/// only one of cert and key; a client CA without cert and key; a file that
/// cannot be read; a cert or CA file without a PEM certificate; a key file
/// without a PEM private key (encrypted keys are not supported); a key that
/// does not match the certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(const std::string& cert_file,
                                                                                    const std::string& key_file,
                                                                                    const std::string& client_ca_file);

}  // namespace logprob
