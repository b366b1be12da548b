#include "common/version.h"

#include "absl/strings/str_cat.h"

namespace logprob {

std::string VersionText(const char* program) {
#ifdef LOGPROB_HAVE_CUDA
#ifndef LOGPROB_CUDA_TOOLKIT_VERSION
#define LOGPROB_CUDA_TOOLKIT_VERSION "unknown"
#endif
  const std::string cuda = absl::StrCat("yes (CUDA toolkit ", LOGPROB_CUDA_TOOLKIT_VERSION, ")");
#else
  const std::string cuda = "no (built without CUDA)";
#endif
  return absl::StrCat(program, " ", kVersion, "\nCUDA backend: ", cuda, "\n");
}

std::string BuildId() {
#ifndef LOGPROB_COMMIT
#define LOGPROB_COMMIT "unknown"
#endif
  return absl::StrCat(kVersion, " (commit ", LOGPROB_COMMIT, ", CUDA ", kBuiltWithCuda ? "yes" : "no", ")");
}

}  // namespace logprob
