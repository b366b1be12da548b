// How a worker loads an lm_head version whose file it cannot read: its
// vocabulary slice streamed by the front-end (Control.ReadLmHeadRows), for
// nodes that do not share the front-end's filesystem (a Ray cluster, pods
// without a shared volume). logprob-worker --fetch-lm-heads picks when.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "logprob/internal/v1/worker.grpc.pb.h"

namespace logprob {

/// When a worker fetches a version's slice from the front-end instead of
/// reading the file (--fetch-lm-heads).
enum class LmHeadFetchMode {
  kNever,   // read the file; a missing file fails the load (one host or a shared volume)
  kAuto,    // read the file when this host has it (weight and bias readable), else fetch
  kAlways,  // always fetch (no file of the front-end's is trusted on this host)
};

/// Parses "never", "auto" or "always"; INVALID_ARGUMENT naming the flag otherwise.
absl::StatusOr<LmHeadFetchMode> ParseLmHeadFetchMode(const std::string& text);

/// Reads rows [row_begin, row_end) of `source`'s weight into `rows`
/// ((row_end - row_begin) * hidden_size elements of source.dtype) and, when
/// `bias` is not null, the same elements of its bias as f32.
using LmHeadRowFetcher = std::function<absl::Status(const internal::v1::LmHeadSource& source, int64_t row_begin,
                                                    int64_t row_end, void* rows, float* bias)>;

/// A fetcher over `control` (the front-end's Control service) for a member
/// of pool generation `generation` (the front-end serves no other). Errors: the
/// RPC's status (PERMISSION_DENIED, NOT_FOUND, DATA_LOSS from the
/// front-end; UNAVAILABLE when it is gone), DATA_LOSS when the stream
/// carries more or fewer bytes than the slice. Each call waits at most
/// `timeout`. Thread-safe.
LmHeadRowFetcher FrontendLmHeadRows(std::shared_ptr<internal::v1::Control::Stub> control, int64_t generation,
                                    std::chrono::milliseconds timeout);

/// True when a load of `source` should fetch: kAlways, or kAuto and this
/// process cannot open the weight (or the bias) file for reading.
bool ShouldFetchLmHead(LmHeadFetchMode mode, const internal::v1::LmHeadSource& source);

}  // namespace logprob
