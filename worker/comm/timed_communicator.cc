#include "worker/comm/timed_communicator.h"

#include <chrono>

namespace logprob {
namespace {

/// Runs `fn` and adds its wall time to *seconds.
template <typename Fn>
absl::Status Timed(double* seconds, Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = fn();
  *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace

absl::Status TimedCommunicator::AllGather(const void* in, size_t bytes, void* out) {
  return Timed(&seconds_, [&] { return inner_.AllGather(in, bytes, out); });
}

absl::Status TimedCommunicator::AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                          const std::vector<int64_t>& recv_bytes) {
  return Timed(&seconds_, [&] { return inner_.AllToAllV(in, send_bytes, out, recv_bytes); });
}

absl::Status TimedCommunicator::AllGatherDevice(const void* in, size_t bytes, void* out) {
  return Timed(&seconds_, [&] { return inner_.AllGatherDevice(in, bytes, out); });
}

absl::Status TimedCommunicator::AllToAllVDevice(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                                const std::vector<int64_t>& recv_bytes) {
  return Timed(&seconds_, [&] { return inner_.AllToAllVDevice(in, send_bytes, out, recv_bytes); });
}

}  // namespace logprob
