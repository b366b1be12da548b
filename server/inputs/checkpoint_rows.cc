#include "server/inputs/checkpoint_rows.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/confined_file.h"
#include "common/positioned_io.h"
#include "common/status_macros.h"

namespace logprob {

absl::StatusOr<std::unique_ptr<CheckpointRows>> CheckpointRows::OpenBeneath(const std::string& dir,
                                                                            const std::string& path,
                                                                            const std::string& tensor,
                                                                            uint64_t max_metadata_bytes) {
  // Every file (the checkpoint, an index's shards, config.json) is opened
  // once beneath dir, no symlink followed, and read only through that
  // descriptor (common/confined_file.h): nothing outside it is read.
  if (dir.empty())
    return absl::PermissionDeniedError(
        "file.path: file sources are off on this server (start it with --lm-head-update-dir DIR)");
  const UniqueFd root(open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root.valid())
    return absl::FailedPreconditionError(absl::StrCat("--lm-head-update-dir ", dir, ": ", strerror(errno)));
  const LmHeadOpener beneath = [&root](const std::string& p, bool dir_ok) {
    return logprob::OpenBeneath(root.get(), p, "file.path", dir_ok);
  };
  LOGPROB_ASSIGN_OR_RETURN(OpenedLmHead opened, ResolveLmHeadWith(beneath, path, tensor, {}, max_metadata_bytes));
  return std::make_unique<CheckpointRows>(std::move(opened));
}

CheckpointRows::CheckpointRows(OpenedLmHead opened)
    : InputSource(InputKind::kFile, opened.source.vocab_size * opened.source.hidden_size *
                                        static_cast<int64_t>(DTypeSize(opened.source.dtype))),
      source_(std::move(opened.source)),
      weight_(std::move(opened.weight)),
      fd_(weight_ ? weight_->get() : -1) {}

bool CheckpointRows::Read(int64_t offset, size_t n, char* dst) const {
  if (fd_ >= 0 && PreadAll(fd_, dst, n, source_.data_offset + static_cast<uint64_t>(offset))) return true;
  std::memset(dst, 0, n);
  absl::MutexLock lock(&mu_);
  if (error_.ok())
    error_ = absl::DataLossError(absl::StrCat("cannot read ", n, " bytes at ", offset, " of ", source_.tensor, " in ",
                                              source_.file, ": ", fd_ < 0 ? "cannot open it" : "short read"));
  return false;
}

absl::Status CheckpointRows::status() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

}  // namespace logprob
