// Which paths lie in the front-end's lm_head update store folder, and
// which of them are finished: the one rule the front-end (writing staged
// versions, server/heads/staged_version.h; serving rows of finished files,
// Control.ReadLmHeadRows) and the workers (writing staged rows,
// Worker.StageLmHeadRows; loading finished files, LmHeadFileRule) agree on.
#pragma once

#include <optional>
#include <string>

#include "absl/strings/match.h"

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

/// The suffix of a version's file while it is staged (being written); the
/// commit renames it away.
inline constexpr char kStagedFileSuffix[] = ".partial";

/// True when `file` is a finished file directly in `store` (StoreFileName,
/// not a staged one): what the front-end serves rows of and workers load.
inline bool IsCommittedStoreFile(const std::string& file, const std::string& store) {
  const std::optional<std::string> name = StoreFileName(file, store);
  return name && !absl::EndsWith(*name, kStagedFileSuffix);
}

/// The name of `file` when it is a staged file directly in `store`
/// (StoreFileName ending kStagedFileSuffix): the only files workers write.
/// nullopt otherwise.
inline std::optional<std::string> StagedStoreFileName(const std::string& file, const std::string& store) {
  std::optional<std::string> name = StoreFileName(file, store);
  if (name && absl::EndsWith(*name, kStagedFileSuffix)) return name;
  return std::nullopt;
}

}  // namespace logprob
