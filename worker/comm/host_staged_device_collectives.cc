#include "worker/comm/host_staged_device_collectives.h"

#include <algorithm>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace logprob {

absl::Status HostStagedDeviceCollectives::Reserve(std::vector<char>& buffer, size_t bytes) {
  const size_t want = std::max<size_t>(bytes, 1);
  if (buffer.size() >= want) return absl::OkStatus();
  try {
    buffer.clear();
    buffer.shrink_to_fit();
    buffer.resize(want);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no host memory to stage a device collective through (", want, " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status HostStagedDeviceCollectives::StageIn(const void* device, size_t bytes, std::vector<char>& buffer) {
  LOGPROB_RETURN_IF_ERROR(Reserve(buffer, bytes));
  return bytes ? copy_->ToHost(buffer.data(), device, bytes) : absl::OkStatus();
}

absl::Status HostStagedDeviceCollectives::Agree(const absl::Status& mine, Step step) {
  LOGPROB_ASSIGN_OR_RETURN(const int failed, FirstRankFlagged(*inner_, !mine.ok()));
  if (failed < 0) return absl::OkStatus();
  if (!mine.ok()) return mine;
  if (step == Step::kStageIn)
    return absl::ResourceExhaustedError(absl::StrCat("device collective over host memory: rank ", failed,
                                                     " could not stage its input (host memory or device copy)"));
  return absl::InternalError(
      absl::StrCat("device collective over host memory: rank ", failed, " could not copy the result to its device"));
}

absl::Status HostStagedDeviceCollectives::AllGatherDevice(const void* in, size_t bytes, void* out) {
  if (bytes == 0) return absl::OkStatus();
  const size_t out_bytes = bytes * static_cast<size_t>(size());
  absl::Status staged = StageIn(in, bytes, in_host_);
  if (staged.ok()) staged = Reserve(out_host_, out_bytes);
  LOGPROB_RETURN_IF_ERROR(Agree(staged, Step::kStageIn));
  LOGPROB_RETURN_IF_ERROR(inner_->AllGather(in_host_.data(), bytes, out_host_.data()));
  return Agree(copy_->ToDevice(out, out_host_.data(), out_bytes), Step::kStageOut);
}

absl::Status HostStagedDeviceCollectives::AllToAllVDevice(const void* in, const std::vector<int64_t>& send_bytes,
                                                          void* out, const std::vector<int64_t>& recv_bytes) {
  const int W = size();
  absl::Status staged = absl::OkStatus();
  size_t in_total = 0, out_total = 0;
  if (static_cast<int>(send_bytes.size()) != W || static_cast<int>(recv_bytes.size()) != W) {
    staged = absl::InvalidArgumentError("AllToAllVDevice needs one send and one receive size per rank");
  } else if (std::any_of(send_bytes.begin(), send_bytes.end(), [](int64_t b) { return b < 0; }) ||
             std::any_of(recv_bytes.begin(), recv_bytes.end(), [](int64_t b) { return b < 0; })) {
    staged = absl::InvalidArgumentError("AllToAllVDevice: negative byte count");
  } else {
    for (int q = 0; q < W; ++q) {
      in_total += static_cast<size_t>(send_bytes[q]);
      out_total += static_cast<size_t>(recv_bytes[q]);
    }
    staged = StageIn(in, in_total, in_host_);
    if (staged.ok()) staged = Reserve(out_host_, out_total);
  }
  LOGPROB_RETURN_IF_ERROR(Agree(staged, Step::kStageIn));
  LOGPROB_RETURN_IF_ERROR(inner_->AllToAllV(in_host_.data(), send_bytes, out_host_.data(), recv_bytes));
  return Agree(out_total ? copy_->ToDevice(out, out_host_.data(), out_total) : absl::OkStatus(), Step::kStageOut);
}

}  // namespace logprob
