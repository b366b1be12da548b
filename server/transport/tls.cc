#include "server/transport/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/security/server_credentials.h"

namespace logprob {
namespace {

absl::Status Bad(const char* flag, const std::string& file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(flag, " ", file, ": ", what));
}

absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return Bad(flag, file, absl::StrCat("cannot read: ", std::strerror(errno)));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return Bad(flag, file, "cannot read");
  return buf.str();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PKeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PKeyPtr = std::unique_ptr<EVP_PKEY, PKeyFree>;

BioPtr MemBio(const std::string& pem) { return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))); }

// The first certificate of `pem`, or null.
X509Ptr FirstCert(const std::string& pem) {
  BioPtr bio = MemBio(pem);
  X509Ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  ERR_clear_error();
  return cert;
}

// The private key of `pem`, or null (also for an encrypted key: no passphrase callback).
PKeyPtr PrivateKey(const std::string& pem) {
  BioPtr bio = MemBio(pem);
  static pem_password_cb* const no_password = [](char*, int, int, void*) { return 0; };
  PKeyPtr key(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, no_password, nullptr) : nullptr);
  ERR_clear_error();
  return key;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFromFiles(const std::string& cert_file,
                                                                                    const std::string& key_file,
                                                                                    const std::string& client_ca_file) {
  if (cert_file.empty() && key_file.empty()) {
    if (!client_ca_file.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--tls-client-ca ", client_ca_file,
                                                     " needs --tls-cert and --tls-key (the server's own certificate)"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (key_file.empty())
    return absl::InvalidArgumentError(absl::StrCat("--tls-cert ", cert_file, " needs --tls-key (its private key)"));
  if (cert_file.empty())
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", key_file, " needs --tls-cert (its certificate)"));

  LOGPROB_ASSIGN_OR_RETURN(const std::string cert, ReadPem("--tls-cert", cert_file));
  LOGPROB_ASSIGN_OR_RETURN(const std::string key, ReadPem("--tls-key", key_file));
  X509Ptr leaf = FirstCert(cert);
  if (!leaf) return Bad("--tls-cert", cert_file, "no PEM certificate in the file");
  PKeyPtr pkey = PrivateKey(key);
  if (!pkey) return Bad("--tls-key", key_file, "no unencrypted PEM private key in the file");
  if (X509_check_private_key(leaf.get(), pkey.get()) != 1) {
    ERR_clear_error();
    return Bad("--tls-key", key_file, absl::StrCat("the key does not match the certificate in --tls-cert ", cert_file));
  }

  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({key, cert});
  if (!client_ca_file.empty()) {
    LOGPROB_ASSIGN_OR_RETURN(const std::string ca, ReadPem("--tls-client-ca", client_ca_file));
    if (!FirstCert(ca)) return Bad("--tls-client-ca", client_ca_file, "no PEM certificate in the file");
    options.pem_root_certs = ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(options);
  if (!creds) return Bad("--tls-cert", cert_file, "gRPC could not build TLS credentials from it");
  return creds;
}

}  // namespace logprob
