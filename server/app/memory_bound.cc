#include "server/app/memory_bound.h"

#include "absl/strings/str_cat.h"
#include "server/pool/payload_pool.h"

namespace logprob {
namespace {

constexpr int64_t kBaseBytes = int64_t{64} << 20;  // 20 MiB measured idle (docs/serving.md), with margin

std::string MiB(int64_t bytes) { return absl::StrCat((bytes + (int64_t{1} << 20) - 1) >> 20, " MiB"); }

}  // namespace

std::string FrontendMemoryBound::Describe() const {
  return absl::StrCat(MiB(total()), " (base ", MiB(base), ", requests ", MiB(requests), ", payload regions ",
                      MiB(payloads), " + ", MiB(idle_payloads), " idle, chunk buffers ", MiB(chunk_buffers),
                      ", kept freed ", MiB(kept_freed),
                      lm_head_store > 0 ? absl::StrCat(", lm_head store ", MiB(lm_head_store)) : "", ")");
}

FrontendMemoryBound ComputeFrontendMemoryBound(const FrontendMemoryLimits& limits) {
  FrontendMemoryBound b;
  b.base = kBaseBytes;
  b.requests = limits.max_queue_bytes + limits.max_queue_bytes / 2;
  if (limits.payload_regions) {
    b.payloads = 2 * limits.max_queue_bytes;
    b.idle_payloads = static_cast<int64_t>(PayloadPool::RegionSize(static_cast<size_t>(limits.max_request_bytes)));
  }
  b.chunk_buffers = limits.max_request_bytes;
  b.kept_freed = limits.keep_freed_bytes;
  b.lm_head_store = limits.lm_head_store_bytes;
  return b;
}

int64_t LmHeadStoreBytes(int64_t weight_bytes, int retain) {
  constexpr int64_t kPage = 4096;
  const int64_t file = (weight_bytes + kPage - 1) / kPage * kPage + kPage;
  return file * LmHeadStoreFiles(retain);
}

}  // namespace logprob
