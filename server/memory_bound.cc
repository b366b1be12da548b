#include "server/memory_bound.h"

#include "absl/strings/str_cat.h"
#include "server/payload_pool.h"

namespace logprob {
namespace {

constexpr int64_t kBaseBytes = int64_t{64} << 20;  // 20 MiB measured idle (docs/serving.md), with margin

std::string MiB(int64_t bytes) { return absl::StrCat((bytes + (int64_t{1} << 20) - 1) >> 20, " MiB"); }

}  // namespace

std::string FrontendMemoryBound::Describe() const {
  return absl::StrCat(MiB(total()), " (base ", MiB(base), ", requests ", MiB(requests), ", payload regions ",
                      MiB(payloads), " + ", MiB(idle_payloads), " idle, chunk buffers ", MiB(chunk_buffers),
                      ", kept freed ", MiB(kept_freed), ")");
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
  return b;
}

}  // namespace logprob
