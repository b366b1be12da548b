// Lets the programs take the SPEC's dashed flag names (--metrics-listen)
// with Abseil flags, whose names use underscores (--metrics_listen).
#pragma once

#include <cstring>

namespace logprob {

/// Rewrites "--foo-bar[=v]" to "--foo_bar[=v]" in place for every argument
/// before a bare "--"; values are untouched.
inline void NormalizeFlagDashes(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* a = argv[i];
    if (std::strcmp(a, "--") == 0) break;
    if (std::strncmp(a, "--", 2) != 0) continue;
    for (char* p = a + 2; *p && *p != '='; ++p)
      if (*p == '-') *p = '_';
  }
}

}  // namespace logprob
