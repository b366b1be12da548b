#include "worker/comm/communicator.h"

#include <cstring>
#include <vector>

namespace logprob {

absl::StatusOr<int> FirstRankFlagged(Communicator& comm, bool flag) {
  const char mine = flag ? 1 : 0;
  std::vector<char> all(static_cast<size_t>(comm.size()));
  if (absl::Status st = comm.AllGather(&mine, 1, all.data()); !st.ok()) return st;
  for (int q = 0; q < comm.size(); ++q)
    if (all[q]) return q;
  return -1;
}

absl::Status Communicator::AllGatherDevice(const void*, size_t, void*) {
  return absl::UnimplementedError("this communicator has no device-memory collectives (host transport)");
}

absl::Status Communicator::AllToAllVDevice(const void*, const std::vector<int64_t>&, void*,
                                           const std::vector<int64_t>&) {
  return absl::UnimplementedError("this communicator has no device-memory collectives (host transport)");
}

absl::Status SelfCommunicator::AllGather(const void* in, size_t bytes, void* out) {
  if (bytes) std::memcpy(out, in, bytes);
  return absl::OkStatus();
}

absl::Status SelfCommunicator::AllToAllV(const void* in, const std::vector<int64_t>& send_bytes, void* out,
                                         const std::vector<int64_t>& recv_bytes) {
  if (send_bytes.size() != 1 || recv_bytes.size() != 1 || send_bytes[0] != recv_bytes[0])
    return absl::InvalidArgumentError("AllToAllV on a group of one needs equal sizes");
  if (send_bytes[0]) std::memcpy(out, in, static_cast<size_t>(send_bytes[0]));
  return absl::OkStatus();
}

}  // namespace logprob
