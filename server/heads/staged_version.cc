#include "server/heads/staged_version.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/lm_head_store_name.h"
#include "common/positioned_io.h"

namespace logprob {

StagedVersion::StagedVersion(LmHeadStore* store, const std::string& head)
    : StagedVersion(store, head, store->NewStem(head)) {}

StagedVersion::StagedVersion(LmHeadStore* store, std::string head, const std::string& stem)
    : store_(store),
      head_(std::move(head)),
      file_(stem + ".safetensors"),
      partial_(absl::StrCat(stem, ".safetensors", kStagedFileSuffix)),
      bias_file_(stem + kStoreBiasSuffix) {}

StagedVersion::~StagedVersion() {
  if (!committed_) Discard();
  if (fd_ >= 0) close(fd_);
}

absl::Status StagedVersion::Create(DType dtype, int64_t V, int64_t H) {
  const std::string header = StoreFileHeader(dtype, V, H);
  data_offset_ = header.size();
  const uint64_t bytes = header.size() + static_cast<uint64_t>(V * H * static_cast<int64_t>(DTypeSize(dtype)));
  fd_ = store_->StagedFile(head_, partial_, bytes, &map_);
  if (fd_ >= 0 && PwriteAll(fd_, header.data(), header.size(), 0)) return absl::OkStatus();
  const int err = errno;
  const std::string why = absl::StrCat("cannot create ", partial_, ": ", strerror(err));
  return err == ENOSPC ? absl::ResourceExhaustedError(why) : absl::InternalError(why);
}

absl::Status StagedVersion::Commit() {
  if (rename(partial_.c_str(), file_.c_str()) != 0)
    return absl::InternalError(absl::StrCat("cannot rename ", partial_, ": ", strerror(errno)));
  committed_ = true;
  return absl::OkStatus();
}

void StagedVersion::Keep(std::unique_ptr<StagedFileHasher> hasher) {
  store_->Keep(file_, std::move(map_), std::move(hasher));
}

void StagedVersion::Discard() {
  if (discarded_) return;
  discarded_ = true;
  unlink(partial_.c_str());
  unlink(file_.c_str());
  unlink(bias_file_.c_str());
}

}  // namespace logprob
