#include "server/pool/lm_head_files.h"

#include "absl/strings/match.h"

namespace logprob {

bool InLmHeadStore(const std::string& file, const std::string& store) {
  if (store.empty() || !absl::StartsWith(file, store + "/")) return false;
  const std::string name = file.substr(store.size() + 1);
  return !name.empty() && name[0] != '.' && name.find('/') == std::string::npos && !absl::EndsWith(name, ".partial");
}

bool IsLiveLmHeadFile(const std::string& file, const std::vector<internal::v1::LmHeadLoad>& alive) {
  if (file.empty()) return false;
  for (const auto& load : alive)
    if (file == load.source().file() || file == load.source().bias_file()) return true;
  return false;
}

}  // namespace logprob
