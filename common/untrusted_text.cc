#include "common/untrusted_text.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace logprob {

std::string Printable(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, max_bytes)), "...(", text.size(), " bytes)");
}

std::string EscapeControlBytes(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto b = static_cast<unsigned char>(c);
    if (b < 0x20 || b == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[b >> 4];
      out += kHex[b & 15];
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace logprob
