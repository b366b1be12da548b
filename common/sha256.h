// SHA-256 digests (OpenSSL).
#pragma once

#include <array>
#include <string>
#include <string_view>

namespace logprob {

/// The 32-byte SHA-256 digest of `text`. Thread-safe.
std::array<unsigned char, 32> Sha256(std::string_view text);

/// Lower-case hex SHA-256 of `text` (64 digits). Thread-safe.
std::string Sha256Hex(std::string_view text);

/// A SHA-256 over bytes fed in order (Update), e.g. a file read in chunks.
/// Not thread-safe.
class Sha256Stream {
 public:
  Sha256Stream();
  ~Sha256Stream();
  Sha256Stream(const Sha256Stream&) = delete;
  Sha256Stream& operator=(const Sha256Stream&) = delete;
  void Update(std::string_view bytes);
  /// Lower-case hex of the digest of everything fed so far; ends the stream.
  std::string FinishHex();

 private:
  void* ctx_;  // EVP_MD_CTX
};

}  // namespace logprob
