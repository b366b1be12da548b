#include "server/inputs/shared_inputs.h"

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "common/error_reason.h"

namespace logprob {
namespace {

class InRegion final : public InputSource {
 public:
  InRegion(std::shared_ptr<const ClientRegion> region, int64_t offset, int64_t byte_size)
      : InputSource(InputKind::kSharedMemory, byte_size), region_(std::move(region)), offset_(offset) {}
  bool Read(int64_t offset, size_t n, char* dst) const override {
    absl::Status st = WithReason(region_->Read(offset_ + offset, n, dst), v1::SHARED_MEMORY_REGION_CHANGED);
    if (st.ok()) return true;
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = std::move(st);
    return false;
  }
  absl::Status status() const override {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  const std::shared_ptr<const ClientRegion> region_;
  const int64_t offset_;
  mutable absl::Mutex mu_;
  mutable absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::shared_ptr<const InputSource> RegionSource(std::shared_ptr<const ClientRegion> region, int64_t offset,
                                                int64_t byte_size) {
  return std::make_shared<InRegion>(std::move(region), offset, byte_size);
}

absl::Status SharedMemoryInputsOff() {
  return WithReason(
      absl::FailedPreconditionError("shared-memory inputs are disabled on this server (--shared-memory-inputs=false)"),
      v1::SHARED_MEMORY_UNAVAILABLE);
}

absl::StatusOr<std::shared_ptr<const InputSource>> ResolveSharedMemory(const v1::Tensor& t, int index,
                                                                       ClientRegions& regions,
                                                                       const std::string& owner) {
  const v1::SharedMemoryRef& ref = t.shared_memory();
  const std::string what = absl::StrCat("inputs[", index, "] \"", t.name(), "\": shared_memory");
  auto region = regions.Find(owner, ref.region());
  if (!region.ok())  // NOT_FOUND, or PERMISSION_DENIED (not confirmed)
    return Prefixed(region.status(), what);
  const int64_t size = (*region)->byte_size();
  if (ref.offset() < 0 || ref.byte_size() < 0 || ref.offset() > size || ref.byte_size() > size - ref.offset())
    return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", ref.offset(), ", ", ref.offset(), " + ",
                                                   ref.byte_size(), ") are outside region \"", ref.region(), "\" of ",
                                                   size, " bytes"));
  const size_t esize = DTypeSize(t.dtype());
  if (esize > 1 && ref.offset() % static_cast<int64_t>(esize) != 0)
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", ref.offset(), " is not a multiple of ",
                                                   DTypeName(t.dtype()), "'s ", esize, " bytes"));
  return RegionSource(*std::move(region), ref.offset(), ref.byte_size());
}

}  // namespace logprob
