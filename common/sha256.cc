#include "common/sha256.h"

#include <openssl/sha.h>

namespace logprob {

std::array<unsigned char, 32> Sha256(std::string_view text) {
  static_assert(SHA256_DIGEST_LENGTH == 32);
  std::array<unsigned char, 32> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

std::string Sha256Hex(std::string_view text) {
  static const char* const kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned char b : Sha256(text)) {
    hex += kHex[b >> 4];
    hex += kHex[b & 15];
  }
  return hex;
}

}  // namespace logprob
