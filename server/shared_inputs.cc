#include "server/shared_inputs.h"

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace logprob {
namespace {

/// Tensors BuildScoreJob reads (the others it only addresses).
bool ReadByValidation(const std::string& name) {
  return name == "input_ids" || name == "seq_lens" || name == "cu_seqlens" || name == "gather_indices";
}

}  // namespace

bool HasSharedMemoryRefs(const v1::ScoreRequest& req) {
  for (const v1::Tensor& t : req.inputs())
    if (t.has_shared_memory()) return true;
  return false;
}

absl::StatusOr<ResolvedInputs> ResolveSharedInputs(const v1::ScoreRequest& req, ClientRegions& regions,
                                                   const std::string& owner) {
  ResolvedInputs out;
  out.data.reserve(req.inputs_size());
  for (int i = 0; i < req.inputs_size(); ++i) {
    const v1::Tensor& t = req.inputs(i);
    if (!t.has_shared_memory()) {
      out.data.emplace_back(t.data());
      continue;
    }
    const v1::SharedMemoryRef& ref = t.shared_memory();
    const std::string what = absl::StrCat("inputs[", i, "] \"", t.name(), "\": shared_memory");
    if (!t.data().empty())
      return absl::InvalidArgumentError(absl::StrCat(what, " given together with data; send one of them"));
    auto region = regions.Find(owner, ref.region());
    if (!region.ok()) return absl::NotFoundError(absl::StrCat(what, ": ", region.status().message()));
    const int64_t size = (*region)->byte_size();
    if (ref.offset() < 0 || ref.byte_size() < 0 || ref.offset() > size || ref.byte_size() > size - ref.offset())
      return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", ref.offset(), ", ", ref.offset(), " + ",
                                                     ref.byte_size(), ") are outside region \"", ref.region(), "\" of ",
                                                     size, " bytes"));
    const size_t esize = DTypeSize(t.dtype());
    if (esize > 1 && ref.offset() % static_cast<int64_t>(esize) != 0)
      return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", ref.offset(), " is not a multiple of ",
                                                     DTypeName(t.dtype()), "'s ", esize, " bytes"));
    out.referenced_bytes += ref.byte_size();
    const char* at = (*region)->base() + ref.offset();
    const size_t n = static_cast<size_t>(ref.byte_size());
    if (ReadByValidation(t.name())) {
      auto copy = std::make_unique<std::string>(n, '\0');
      RegionReader reader(*region);
      if (!reader.Read(copy->data(), at, n))
        return absl::FailedPreconditionError(
            absl::StrCat("inputs[", i, "] \"", t.name(), "\": ", reader.status().message()));
      out.data.emplace_back(*copy);
      out.owned.push_back(std::move(copy));
    } else {
      if (out.rows_source && &out.rows_source->region() != region->get())
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": logits / hidden_states of one request must lie in one region"));
      if (!out.rows_source) out.rows_source = std::make_shared<RegionReader>(*region);
      out.data.emplace_back(at, n);
    }
  }
  return out;
}

}  // namespace logprob
