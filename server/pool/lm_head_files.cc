#include "server/pool/lm_head_files.h"

namespace logprob {

bool IsLiveLmHeadFile(const std::string& file, const std::vector<internal::v1::LmHeadLoad>& alive) {
  if (file.empty()) return false;
  for (const auto& load : alive)
    if (file == load.source().file() || file == load.source().bias_file()) return true;
  return false;
}

}  // namespace logprob
