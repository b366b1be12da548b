#include "worker/cuda/device_info.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace logprob::cuda {

absl::StatusOr<int> DeviceCount() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: cudaGetDeviceCount: ", cudaGetErrorString(e)));
  if (n == 0) return absl::FailedPreconditionError("no CUDA device found");
  return n;
}

absl::StatusOr<int> SelectDevice(int requested, int rank) {
  LOGPROB_ASSIGN_OR_RETURN(const int n, DeviceCount());
  if (requested >= n)
    return absl::InvalidArgumentError(absl::StrCat("--device ", requested, ": only ", n, " CUDA device(s)"));
  const int device = requested >= 0 ? requested : rank % n;
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    return absl::FailedPreconditionError(absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
  return device;
}

std::string DeviceDescription(int device) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return absl::StrCat("device ", device);
  return absl::StrCat(p.name, " (sm_", p.major, p.minor, ", ", p.totalGlobalMem >> 30, " GiB)");
}

double PeakMemoryBandwidth(int device) {
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess)
    return 0.0;
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0);
}

}  // namespace logprob::cuda
