// Lets the programs take the SPEC's dashed flag names (--metrics-listen)
// with Abseil flags, whose names use underscores (--metrics_listen).
#pragma once

#include <cstring>
#include <string>
#include <vector>

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

/// True if flag `name` (underscores) is on the command line ("--name",
/// "--name=v", "-name", "-name=v") before a bare "--". Call after
/// NormalizeFlagDashes.
inline bool FlagGiven(int argc, char** argv, const char* name) {
  const size_t n = std::strlen(name);
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--") == 0) break;
    if (a[0] != '-') continue;
    a += a[1] == '-' ? 2 : 1;
    if (std::strncmp(a, name, n) == 0 && (a[n] == '\0' || a[n] == '=')) return true;
  }
  return false;
}

/// Every value of flag `name` (underscores) on the command line, in order
/// ("--name=v" or "--name v", one or two dashes), before a bare "--":
/// for a flag that may be repeated (Abseil keeps only the last). Call after
/// NormalizeFlagDashes.
inline std::vector<std::string> FlagValues(int argc, char** argv, const char* name) {
  std::vector<std::string> values;
  const size_t n = std::strlen(name);
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--") == 0) break;
    if (a[0] != '-') continue;
    a += a[1] == '-' ? 2 : 1;
    if (std::strncmp(a, name, n) != 0) continue;
    if (a[n] == '=') values.emplace_back(a + n + 1);
    if (a[n] == '\0' && i + 1 < argc) values.emplace_back(argv[++i]);
  }
  return values;
}

}  // namespace logprob
