// The release version of the server, workers and CLI. One source: the
// VERSION file at the repository's root, which CMake passes in as
// LOGPROB_VERSION; the Python client's pyproject.toml must say the same
// (ctest version_agrees).
#pragma once

#ifndef LOGPROB_VERSION
#error "LOGPROB_VERSION is set by CMake from the VERSION file"
#endif

namespace logprob {

/// "MAJOR.MINOR.PATCH" (ServerInfo.version, logprob_build_info{version}).
inline constexpr char kVersion[] = LOGPROB_VERSION;

}  // namespace logprob
