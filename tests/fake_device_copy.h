// A DeviceCopy (worker/comm/host_staged_device_collectives.h) for CPU tests:
// "device memory" is host memory, copies are memcpy. Records every call
// and can fail the next copy in either direction, so tests check what the
// staging moved and how the ranks agree on a failure.
#pragma once

#include <cstring>
#include <vector>

#include "worker/comm/host_staged_device_collectives.h"

namespace logprob::testing {

/// Host-memory DeviceCopy with a call log and injected failures. Not
/// thread-safe (one per rank's thread).
class FakeDeviceCopy final : public DeviceCopy {
 public:
  /// One recorded copy.
  struct Call {
    bool to_device;      // ToDevice, else ToHost
    const void* device;  // the "device" pointer
    size_t bytes;
  };
  absl::Status ToHost(void* host, const void* device, size_t bytes) override {
    calls.push_back({false, device, bytes});
    if (fail_to_host || fail_to_host_after == 0) return absl::InternalError("injected ToHost failure");
    if (fail_to_host_after > 0) --fail_to_host_after;
    if (bytes) std::memcpy(host, device, bytes);
    return absl::OkStatus();
  }
  absl::Status ToDevice(void* device, const void* host, size_t bytes) override {
    calls.push_back({true, device, bytes});
    if (fail_to_device) return absl::InternalError("injected ToDevice failure");
    if (bytes) std::memcpy(device, host, bytes);
    return absl::OkStatus();
  }
  std::vector<Call> calls;
  bool fail_to_host = false, fail_to_device = false;
  /// >= 0: ToHost fails once this many more ToHost calls have succeeded
  /// (and from then on); -1: never (unless fail_to_host).
  int fail_to_host_after = -1;
};

}  // namespace logprob::testing
