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

}  // namespace logprob
