// Printing what a request names (heads, versions, paths, ids, regions) in
// logs and errors: escaped, so a name cannot forge a log line, and cut, so
// a long name cannot blow up an error or its gRPC trailer (issue 32).
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace logprob {

/// The most bytes of a caller's text that Printable keeps by default.
inline constexpr size_t kPrintableBytes = 96;

/// `text` as it may be printed in a log line or an error message: its first
/// `max_bytes` bytes C-escaped with absl::CHexEscape (newline "\n", NUL
/// "\x00", other control and non-ASCII bytes "\xNN", quote and backslash
/// escaped), followed by "...(N bytes)" when it was longer. Pure; thread-safe.
std::string Printable(absl::string_view text, size_t max_bytes = kPrintableBytes);

/// `text` with its control bytes (0x00-0x1f and 0x7f: newline, ESC, NUL,
/// ...) written as "\xNN" and everything else unchanged: the last guard of
/// every status message a client receives (ToGrpc), so that a name from a
/// request or a file that reached a message unescaped still cannot forge
/// lines or terminal escapes in the client's logs. Pure; thread-safe.
std::string EscapeControlBytes(absl::string_view text);

}  // namespace logprob
