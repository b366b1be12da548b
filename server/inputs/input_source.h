// The bytes of one request tensor, wherever they live: the one place the
// front-end reads them from or refers workers to. A request's tensors are
// resolved into sources once (server/inputs/request_inputs.h); every later stage
// (validation, batching, planning) goes through this interface and does
// not know which kinds exist. Future inputs (lm_head rows of an update)
// take their bytes from the same sources.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "common/input_kind.h"
#include "logprob/internal/v1/worker.pb.h"

namespace logprob {

/// One tensor's bytes (byte_size() of them). Immutable, except for the
/// error a failed Read records. Thread-safe.
class InputSource {
 public:
  explicit InputSource(InputKind kind, int64_t byte_size) : kind_(kind), byte_size_(byte_size) {}
  virtual ~InputSource() = default;
  InputSource(const InputSource&) = delete;
  InputSource& operator=(const InputSource&) = delete;

  InputKind kind() const { return kind_; }
  /// What this kind of source allows (common/input_kind.h).
  const InputKindRules& rules() const { return RulesOf(kind_); }
  int64_t byte_size() const { return byte_size_; }

  /// The bytes, when they are in this process's memory (valid while the
  /// request is: see Batcher's Lifetimes); nullopt when they must be read
  /// with Read or cannot be read here.
  virtual std::optional<std::string_view> memory() const { return std::nullopt; }
  /// Copies bytes [offset, offset + n) to `dst`. False when they cannot be
  /// read (the rest of `dst` is zero-filled and status() keeps why).
  /// Requires offset + n <= byte_size().
  virtual bool Read(int64_t offset, size_t n, char* dst) const = 0;
  /// OK, or why a Read failed (the first failure).
  virtual absl::Status status() const { return absl::OkStatus(); }
  /// For sources the workers read themselves (rules().readable_here
  /// false): sets `item`'s payload to a reference to bytes [offset,
  /// offset + n). Others leave the item alone and return false.
  virtual bool Refer(int64_t /*offset*/, int64_t /*n*/, internal::v1::WorkItem* /*item*/) const { return false; }

 private:
  const InputKind kind_;
  const int64_t byte_size_;
};

/// Bytes in this process's memory (Tensor.data, or assembled ScoreChunked
/// pieces). The source views `data`, which its owner keeps valid while the
/// request is (Batcher's Lifetimes).
std::shared_ptr<const InputSource> MemorySource(std::string_view data);

}  // namespace logprob
