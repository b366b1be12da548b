// Which files a worker may fetch lm_head rows of through the control plane
// (Control.ReadLmHeadRows, server/pool/control_lm_head_rows.cc): only files the
// front-end itself serves heads from, never any path a caller names: the
// live versions' files (here) and the update store's finished files
// (IsCommittedStoreFile, common/lm_head_store_name.h).
#pragma once

#include <string>
#include <vector>

#include "logprob/internal/v1/worker.pb.h"

namespace logprob {

/// True when `file` (not empty) is the weight or bias file of one of
/// `alive` (the versions LmHeads::Alive lists).
bool IsLiveLmHeadFile(const std::string& file, const std::vector<internal::v1::LmHeadLoad>& alive);

}  // namespace logprob
