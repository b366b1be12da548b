// Which paths lie in the front-end's lm_head update store folder: the one
// rule the front-end (serving rows of store files, server/pool/
// lm_head_files.h) and the workers (writing staged rows,
// Worker.StageLmHeadRows) agree on.
#pragma once

#include <optional>
#include <string>

namespace logprob {

/// The name of `file` when it lies directly in the store folder `store`:
/// file == store + "/" + name with a non-empty name that holds no '/' and
/// does not start with '.' (so neither ".." nor a hidden file). Lexical
/// only: a caller opens the name with openat(store's descriptor, name,
/// O_NOFOLLOW), so that a link in the folder cannot lead out of it.
/// nullopt otherwise, and always for an empty `store`. Thread-safe.
inline std::optional<std::string> StoreFileName(const std::string& file, const std::string& store) {
  if (store.empty() || file.size() <= store.size() + 1 || file.compare(0, store.size(), store) != 0 ||
      file[store.size()] != '/')
    return std::nullopt;
  std::string name = file.substr(store.size() + 1);
  if (name[0] == '.' || name.find('/') != std::string::npos) return std::nullopt;
  return name;
}

}  // namespace logprob
