// The release version of the server, workers and CLI. One source: the
// VERSION file at the repository's root, which CMake passes in as
// LOGPROB_VERSION; the Python client's pyproject.toml must say the same
// (ctest version_agrees).
#pragma once

#include <string>

#ifndef LOGPROB_VERSION
#error "LOGPROB_VERSION is set by CMake from the VERSION file"
#endif

namespace logprob {

/// "MAJOR.MINOR.PATCH" (ServerInfo.version, logprob_build_info{version}).
inline constexpr char kVersion[] = LOGPROB_VERSION;

/// True when this build has the CUDA backend (nvcc and NCCL were found:
/// LOGPROB_HAVE_CUDA; `--backend cuda` works only then).
inline constexpr bool kBuiltWithCuda =
#ifdef LOGPROB_HAVE_CUDA
    true;
#else
    false;
#endif

/// What `PROGRAM --version` prints (logprob-server, logprob-worker and
/// logprob-client alike), two lines ending in '\n':
///   "<program> <kVersion>"
///   "CUDA backend: yes (CUDA toolkit <X.Y.Z>)" or
///   "CUDA backend: no (built without CUDA)"
/// The toolkit version is the one CMake found at build time. Thread-safe.
std::string VersionText(const char* program);

/// This build: "<kVersion> (commit <12 hex digits, or unknown>, CUDA
/// yes|no)", the commit CMake was configured from. A front-end and a worker
/// of different builds refuse each other when the worker joins
/// (JoinRequest.build / JoinReply.build). Thread-safe.
std::string BuildId();

}  // namespace logprob
