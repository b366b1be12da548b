#include "worker/heads/device_file_copy.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/positioned_io.h"

namespace logprob {

absl::Status CopyDeviceToFile(DeviceCopy& copy, const void* device, size_t bytes, int fd, uint64_t file_offset,
                              std::vector<char>* buffer, size_t chunk_bytes) {
  if (chunk_bytes == 0) return absl::InvalidArgumentError("CopyDeviceToFile: chunk_bytes must be > 0");
  if (bytes == 0) return absl::OkStatus();
  if (device == nullptr) return absl::InvalidArgumentError("CopyDeviceToFile: null device pointer");
  const size_t step = std::min(bytes, chunk_bytes);
  if (buffer->size() < step) {
    try {
      buffer->resize(step);
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", step, " bytes of host staging buffer"));
    }
  }
  const char* src = static_cast<const char*>(device);
  for (size_t off = 0; off < bytes;) {
    const size_t n = std::min(step, bytes - off);
    if (absl::Status st = copy.ToHost(buffer->data(), src + off, n); !st.ok())
      return absl::Status(st.code(), absl::StrCat("copying bytes [", off, ", ", off + n, ") of ", bytes,
                                                  " from the device: ", st.message()));
    if (!PwriteAll(fd, buffer->data(), n, file_offset + off))
      return absl::InternalError(absl::StrCat("writing bytes [", off, ", ", off + n, ") of ", bytes, " at file offset ",
                                              file_offset + off, ": ", std::strerror(errno)));
    off += n;
  }
  return absl::OkStatus();
}

}  // namespace logprob
