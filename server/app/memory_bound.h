// The front-end's memory bound, derived from its limits (docs/serving.md,
// "Memory sizing"): what an operator can give the process (a container's
// memory limit) knowing it never needs more.
#pragma once

#include <cstdint>
#include <string>

namespace logprob {

/// The limits the front-end's memory follows from (server flags).
struct FrontendMemoryLimits {
  int64_t max_queue_bytes = 0;    // --max-queue-bytes: admitted, unanswered request bytes
  int64_t max_request_bytes = 0;  // --max-request-bytes
  int64_t keep_freed_bytes = 0;   // --keep-freed-memory-bytes (resolved; 0: glibc's defaults)
  bool payload_regions = false;   // local workers with --shared-memory: payloads in /dev/shm
  /// With --allow-lm-head-updates: the store files of updated versions the
  /// front-end maps, LmHeadStoreBytes of the heads updates may change.
  int64_t lm_head_store_bytes = 0;
};

/// The most the lm_head store holds for one updatable head whose weight is
/// `weight_bytes`: every retained version (`retain`), one staged update,
/// and up to two released files kept for the next updates (docs/serving.md
/// --lm-head-store-dir), each rounded up to whole pages plus a page of
/// header: weight_bytes' pages x (retain + 3).
int64_t LmHeadStoreBytes(int64_t weight_bytes, int retain);

/// The store files LmHeadStoreBytes counts for one head: retain + 3. The
/// update protocol holds a head to it (LmHeadUpdates::Options).
inline int LmHeadStoreFiles(int retain) { return retain + 3; }

/// Upper bound of the front-end's resident memory (VmRSS, anonymous plus
/// the /dev/shm pages it maps), by part, bytes:
///   base            fixed: code, gRPC's threads and buffers, the registries;
///   requests        1.5 x max_queue_bytes: each admitted request's bytes
///                   (the parsed message, or a ScoreChunked request's
///                   assembled buffers) plus its outputs and working copies;
///   payloads        the in-flight work items' payload regions, in
///                   power-of-two regions: <= 2 x max_queue_bytes (0
///                   without payload regions);
///   idle_payloads   payload regions kept for reuse: <= the PayloadPool's
///                   byte cap, RegionSize(max_request_bytes);
///   chunk_buffers   idle ScoreChunked buffers: <= max_request_bytes;
///   kept_freed      freed heap kept resident: keep_freed_bytes (malloc's
///                   trim threshold, and TrimKeptFreedMemory around large
///                   requests: common/malloc_tuning.h);
///   lm_head_store   the store files of lm_head versions (updates), which
///                   the front-end writes through a mapping:
///                   lm_head_store_bytes.
/// Every request byte counts in the admission from before it arrives until
/// the answer (a request's sampling masks count again for the copies the
/// front-end makes of them, ScoreJob::mask_working_bytes, which can be
/// several times the message's share, and a backward's dL/dh,
/// ScoreJob::backward_working_bytes): a unary Score reserves its announced size (else
/// max_request_bytes) before its body is read and is refused without
/// reading it when the queue has no room, ScoreChunked counts its
/// announced total from its first part (server/transport/scoring_service.h Reserve),
/// and the admitted request keeps that share; a ScoreStream reserves each
/// message's bytes (its announced largest, else max_request_bytes) before
/// reading it (ScoringService::ReserveStreamed). The lm_head store
/// part holds because an update that would take a head over
/// LmHeadStoreFiles(retain) files is refused (server/heads/lm_head_updates.h).
/// The request bytes of registered client shared-memory regions are the
/// clients' pages and are read with pread, never mapped: not counted.
/// Thread-compatible value type.
struct FrontendMemoryBound {
  int64_t base = 0, requests = 0, payloads = 0, idle_payloads = 0, chunk_buffers = 0, kept_freed = 0, lm_head_store = 0;

  int64_t total() const {
    return base + requests + payloads + idle_payloads + chunk_buffers + kept_freed + lm_head_store;
  }
  /// One line: "N MiB (base .., requests .., ...)" (the lm_head store when
  /// not 0).
  std::string Describe() const;
};

/// The bound for `limits` (see FrontendMemoryBound).
FrontendMemoryBound ComputeFrontendMemoryBound(const FrontendMemoryLimits& limits);

/// Fixed part of each CPU worker's resident memory, bytes (oneDNN, Gloo,
/// gRPC, libraries); a worker adds its lm_head versions (up to
/// --lm-head-retain + 1 of each head, each LmHeadWorkerBytes: its slice in
/// the checkpoint's dtype, mapped from an in-memory store or copied, with
/// no converted copy on any CPU), the GEMM's per-thread tile of 128 x H
/// floats, one hidden-states round (--hidden-chunk-tokens x V x 4), the
/// lm_head gradient steps it holds (at most --max-gradient-step-bytes,
/// docs/gradients.md) and the payload regions it maps.
inline constexpr int64_t kWorkerBaseBytes = int64_t{256} << 20;

}  // namespace logprob
