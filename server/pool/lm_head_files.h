// Which files a worker may fetch lm_head rows of through the control plane
// (Control.ReadLmHeadRows, server/pool/control_lm_head_rows.cc): only files the
// front-end itself serves heads from, never any path a caller names.
#pragma once

#include <string>
#include <vector>

#include "logprob/internal/v1/worker.pb.h"

namespace logprob {

/// True when `file` is a finished file directly in the update store `store`
/// ("STORE/NAME", NAME not starting with "." (the folder's lock) nor a ".partial" file still being
/// written). Pure string test on the paths as the front-end wrote them.
bool InLmHeadStore(const std::string& file, const std::string& store);

/// True when `file` (not empty) is the weight or bias file of one of
/// `alive` (the versions LmHeads::Alive lists).
bool IsLiveLmHeadFile(const std::string& file, const std::vector<internal::v1::LmHeadLoad>& alive);

}  // namespace logprob
