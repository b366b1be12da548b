// SHA-256 digests as hex text (OpenSSL).
#pragma once

#include <string>
#include <string_view>

namespace logprob {

/// Lower-case hex SHA-256 of `text` (64 digits).
std::string Sha256Hex(std::string_view text);

}  // namespace logprob
