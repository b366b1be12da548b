#include "common/sha256.h"

#include <openssl/evp.h>
#include <openssl/sha.h>

namespace logprob {

std::array<unsigned char, 32> Sha256(std::string_view text) {
  static_assert(SHA256_DIGEST_LENGTH == 32);
  std::array<unsigned char, 32> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

namespace {

std::string Hex(const std::array<unsigned char, 32>& digest) {
  static const char* const kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned char b : digest) {
    hex += kHex[b >> 4];
    hex += kHex[b & 15];
  }
  return hex;
}

}  // namespace

std::string Sha256Hex(std::string_view text) { return Hex(Sha256(text)); }

Sha256Stream::Sha256Stream() : ctx_(EVP_MD_CTX_new()) {
  EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr);
}

Sha256Stream::~Sha256Stream() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256Stream::Update(std::string_view bytes) {
  EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), bytes.data(), bytes.size());
}

std::string Sha256Stream::FinishHex() {
  std::array<unsigned char, 32> digest{};
  unsigned int n = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), digest.data(), &n);
  return Hex(digest);
}

}  // namespace logprob
