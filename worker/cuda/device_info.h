// Which CUDA devices this process can use, as a Status (for clear errors
// and for tests that skip without a GPU).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace logprob::cuda {

/// Number of CUDA devices; FAILED_PRECONDITION with the driver's message
/// when there is none or no usable driver.
absl::StatusOr<int> DeviceCount();

/// The device a worker of `rank` uses: `requested` when >= 0 (checked
/// against DeviceCount()), else rank % DeviceCount(). Sets it current for
/// the calling thread. INVALID_ARGUMENT for a device that does not exist.
absl::StatusOr<int> SelectDevice(int requested, int rank);

/// "NAME (sm_XY, N GiB)" of `device`, for logs.
std::string DeviceDescription(int device);

/// Peak DRAM bandwidth of `device` in bytes/s from its memory clock and
/// bus width (2 transfers per clock), 0 when the attributes are missing.
double PeakMemoryBandwidth(int device);

}  // namespace logprob::cuda
