#include "server/pool/lm_head_files.h"

#include <optional>

#include "absl/strings/match.h"
#include "common/lm_head_store_name.h"

namespace logprob {

bool InLmHeadStore(const std::string& file, const std::string& store) {
  const std::optional<std::string> name = StoreFileName(file, store);
  return name && !absl::EndsWith(*name, ".partial");
}

bool IsLiveLmHeadFile(const std::string& file, const std::vector<internal::v1::LmHeadLoad>& alive) {
  if (file.empty()) return false;
  for (const auto& load : alive)
    if (file == load.source().file() || file == load.source().bias_file()) return true;
  return false;
}

}  // namespace logprob
