#include "worker/heads/lm_head_registry.h"

#include <chrono>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/huge_pages.h"
#include "common/lm_head_source.h"
#include "common/lm_head_source_proto.h"
#include "common/lm_head_store_name.h"
#include "common/log_line.h"
#include "common/partition.h"
#include "common/status_macros.h"

namespace logprob {
namespace {

// The transform part of a source (scalars and bias location), compared
// bitwise: a load of a held version with another transform replaces it.
std::string TransformKey(const internal::v1::LmHeadSource& src) {
  internal::v1::LmHeadSource t;
  t.set_logit_scale(src.logit_scale());
  t.set_final_logit_softcapping(src.final_logit_softcapping());
  t.set_bias_file(src.bias_file());
  t.set_bias_tensor(src.bias_tensor());
  t.set_bias_dtype(src.bias_dtype());
  t.set_bias_offset(src.bias_offset());
  return t.SerializeAsString();
}

}  // namespace

LmHeadFileRule LmHeadFileRule::Of(const internal::v1::JoinReply& joined) {
  LmHeadFileRule rule;
  rule.store_dir = joined.lm_head_store_dir();
  for (const internal::v1::LmHeadLoad& load : joined.lm_heads()) {
    rule.named.insert(load.source().file());
    if (!load.source().bias_file().empty()) rule.named.insert(load.source().bias_file());
  }
  return rule;
}

bool LmHeadFileRule::Allows(const std::string& file) const {
  return named.count(file) > 0 || IsCommittedStoreFile(file, store_dir);
}

absl::StatusOr<int64_t> LmHeadRegistry::Load(const internal::v1::LmHeadLoad& load) {
  const internal::v1::LmHeadRef& ref = load.head();
  if (ref.name().empty() || ref.version().empty())
    return absl::InvalidArgumentError("LoadLmHead: the head's name and version must not be empty");
  const Key key = KeyOf(ref);
  const internal::v1::LmHeadSource& src = load.source();
  // Held from the same file: nothing to read. From another one, the copy is
  // stale (a drop this worker missed, then the name committed again with
  // other bytes) and is replaced.
  auto same_source = [&src](const Held& h) {
    return h.file == src.file() && h.data_offset == src.data_offset() && h.transform == TransformKey(src);
  };
  {
    absl::MutexLock lock(&mu_);
    if (auto it = held_.find(key); it != held_.end() && same_source(it->second))
      return static_cast<int64_t>(it->second.weights->bytes());
  }
  LOGPROB_ASSIGN_OR_RETURN(const LmHeadSource source,
                           LmHeadSourceFromProto(src, absl::StrCat("LoadLmHead ", ref.name(), "@", ref.version())));
  const auto [vb, ve] = SplitRange(source.vocab_size, world_, rank_);
  const auto t0 = std::chrono::steady_clock::now();
  LmHeadSlice slice;
  slice.dtype = source.dtype;
  slice.rows = ve - vb;
  slice.hidden_size = source.hidden_size;
  slice.transform = source.transform;
  // A file this host does not have (another node than the front-end's):
  // the slice comes from the front-end.
  const bool fetched = ShouldFetchLmHead(fetch_mode_, src);
  // Only the files the front-end serves heads from (none when fetched).
  if (files_ && !fetched)
    for (const std::string* file : {&src.file(), &src.bias_file()})
      if (!file->empty() && !files_->Allows(*file))
        return absl::PermissionDeniedError(
            absl::StrCat("LoadLmHead ", ref.name(), "@", ref.version(), ": ", *file,
                         " is neither a committed file of the front-end's lm_head store (", files_->store_dir,
                         ") nor a file of the heads the front-end named when this worker joined"));
  if (source.transform.has_bias) {
    slice.bias.resize(static_cast<size_t>(ve - vb));
    if (!fetched) LOGPROB_RETURN_IF_ERROR(ReadLmHeadBias(source, vb, ve, slice.bias.data()));
  }
  const size_t row_bytes = static_cast<size_t>(source.hidden_size) * DTypeSize(source.dtype);
  const size_t read_bytes = static_cast<size_t>(ve - vb) * row_bytes;
  // A committed update's store file in memory: its pages become the
  // slice's (no copy, no second copy of the head in memory), through the
  // mapping an earlier version of the same recycled file left on standby.
  absl::StatusOr<HostBytes> mapped = absl::UnimplementedError("a checkpoint is copied");
  if (src.immutable() && !fetched)
    mapped = HostBytes::MapMemoryFile(source.file, source.data_offset + static_cast<uint64_t>(vb) * row_bytes,
                                      read_bytes, &standby_);
  if (mapped.ok()) {
    slice.weight = *std::move(mapped);
  } else {
    std::vector<char> copy;
    copy.reserve(read_bytes);
    // Untouched yet: huge pages take the slice in a few hundred page faults.
    AdviseHugePages(copy.data(), copy.capacity());
    copy.resize(read_bytes);
    LOGPROB_RETURN_IF_ERROR(
        fetched ? fetch_(src, vb, ve, copy.data(), source.transform.has_bias ? slice.bias.data() : nullptr)
                : ReadLmHeadRows(source, vb, ve, copy.data()));
    slice.weight = HostBytes(std::move(copy));
  }
  const bool was_mapped = slice.weight.mapped();
  LOGPROB_ASSIGN_OR_RETURN(std::shared_ptr<const LmHeadWeights> weights,
                           backend_.LoadLmHead(std::move(slice), precision_));
  const int64_t bytes = static_cast<int64_t>(weights->bytes());
  const std::string described = weights->Describe();
  std::shared_ptr<const LmHeadWeights> stale;  // freed outside the lock
  {
    absl::MutexLock lock(&mu_);
    auto it = held_.find(key);
    if (it == held_.end()) {
      held_.emplace(key, Held{std::move(weights), src.file(), src.data_offset(), TransformKey(src)});
    } else if (!same_source(it->second)) {
      stale = std::exchange(it->second.weights, std::move(weights));
      it->second.file = src.file();
      it->second.data_offset = src.data_offset();
      it->second.transform = TransformKey(src);
    }  // else a concurrent Load of the same version: the first stays
  }
  LogLine() << absl::StrCat("logprob-worker: rank ", rank_, " loaded lm_head ", ref.name(), " version ", ref.version(),
                            ": ", source.tensor, " rows [", vb, ", ", ve, ") x ", source.hidden_size, " ",
                            DTypeName(source.dtype),
                            was_mapped ? " mapped from "
                            : fetched  ? " fetched from the front-end: "
                                       : " from ",
                            source.file, " (", read_bytes >> 20, " MiB), transform ", source.transform.ToString(),
                            ", holds ", bytes >> 20, " MiB", described.empty() ? "" : ", ", described, " in ",
                            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), " s");
  return bytes;
}

std::shared_ptr<const LmHeadWeights> LmHeadRegistry::Find(const internal::v1::LmHeadRef& head) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(KeyOf(head));
  return it == held_.end() ? nullptr : it->second.weights;
}

bool LmHeadRegistry::Drop(const internal::v1::LmHeadRef& head) {
  std::shared_ptr<const LmHeadWeights> dropped;  // freed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = held_.find(KeyOf(head));
  if (it == held_.end()) return false;
  dropped = std::move(it->second.weights);
  held_.erase(it);
  return true;
}

size_t LmHeadRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return held_.size();
}

}  // namespace logprob
