#include "server/heads/lm_head_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <iterator>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log_line.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace logprob {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kSparesPerHead = 2;  // released store files kept for the next updates

}  // namespace

std::string StoreFileHeader(DType dtype, int64_t V, int64_t H) {
  constexpr size_t kPage = 4096;
  const int64_t bytes = V * H * static_cast<int64_t>(DTypeSize(dtype));
  std::string json = absl::StrCat("{\"", kLmHeadTensor, "\":{\"dtype\":\"", DTypeName(dtype), "\",\"shape\":[", V, ",",
                                  H, "],\"data_offsets\":[0,", bytes, "]}}");
  json.resize((json.size() + 8 + kPage - 1) / kPage * kPage - 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

LmHeadStore::LmHeadStore(std::string dir, std::chrono::steady_clock::duration spare_idle)
    : dir_(std::move(dir)), spare_idle_(spare_idle) {}

LmHeadStore::~LmHeadStore() {
  absl::MutexLock lock(&mu_);
  for (const auto& [head, spares] : spares_)
    for (const Spare& spare : spares) unlink(spare.path.c_str());
}

std::string LmHeadStore::NewStem(const std::string& head) {
  absl::MutexLock lock(&mu_);
  return absl::StrCat(dir_, "/", head, "-", next_file_++);
}

bool LmHeadStore::IsOwn(const std::string& file) const { return absl::StartsWith(file, dir_ + "/"); }

bool LmHeadStore::HasSpare(const std::string& head) const {
  absl::MutexLock lock(&mu_);
  const auto it = spares_.find(head);
  return it != spares_.end() && !it->second.empty();
}

bool LmHeadStore::IsOwnBias(const std::string& file) const {
  return absl::StartsWith(file, dir_ + "/") && absl::EndsWith(file, kStoreBiasSuffix);
}

absl::StatusOr<LmHeadBiasSource> LmHeadStore::WriteBias(const std::string& path, const v1::Tensor& bias) {
  if (absl::Status st = WriteSafetensors(path, {bias}); !st.ok())
    return absl::Status(st.code() == absl::StatusCode::kResourceExhausted ? st.code() : absl::StatusCode::kInternal,
                        absl::StrCat("lm_head update: cannot write the bias ", path, ": ", st.message()));
  LOGPROB_ASSIGN_OR_RETURN(const SafetensorsHeader header, ReadSafetensorsHeader(path));
  const SafetensorsEntry* e = header.Find(bias.name());
  if (e == nullptr) return absl::InternalError(absl::StrCat(path, ": the bias just written is missing"));
  return LmHeadBiasSource{path, e->name, e->dtype, header.data_start + e->begin};
}

absl::StatusOr<LmHeadBiasSource> LmHeadStore::CopyBias(const LmHeadBiasSource& from, const std::string& path) {
  std::error_code ec;
  fs::copy_file(from.file, path, fs::copy_options::overwrite_existing, ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("lm_head update: cannot copy the head's bias ", from.file, " to ", path, ": ", ec.message()));
  return LmHeadBiasSource{path, from.tensor, from.dtype, from.data_offset};
}

void LmHeadStore::Keep(const std::string& file, FileMap map, std::unique_ptr<StagedFileHasher> hasher) {
  absl::MutexLock lock(&mu_);
  hashing_[file] = std::move(hasher);
  maps_[file] = std::move(map);
}

void LmHeadStore::Recycle(const LmHeadVersion& v, bool dropped) {
  // The version's own bias file goes with it (no other version reads it).
  if (IsOwnBias(v.source.bias.file)) unlink(v.source.bias.file.c_str());
  std::unique_ptr<StagedFileHasher> hasher;
  FileMap map;
  std::string spare;
  {
    absl::MutexLock lock(&mu_);
    // A released version's digest is listed nowhere any more: a hash still
    // running is abandoned, so the file can be rewritten.
    if (auto it = hashing_.find(v.source.file); it != hashing_.end()) {
      hasher = std::move(it->second);
      hashing_.erase(it);
    }
    if (auto it = maps_.find(v.source.file); it != maps_.end()) {
      map = std::move(it->second);
      maps_.erase(it);
    }
    // Only a file no worker maps any more, up to kSparesPerHead per head.
    if (dropped && spares_[v.head].size() < kSparesPerHead)
      spare = absl::StrCat(dir_, "/", v.head, ".spare-", next_file_++);
  }
  hasher.reset();  // its thread stops reading the file
  if (!spare.empty() && rename(v.source.file.c_str(), spare.c_str()) == 0) {
    absl::MutexLock lock(&mu_);
    std::vector<Spare>& spares = spares_[v.head];
    if (spares.size() < kSparesPerHead) {
      spares.push_back(Spare{spare, std::move(map), Clock::now()});
      return;
    }
    unlink(spare.c_str());
    return;
  }
  unlink(v.source.file.c_str());
}

void LmHeadStore::Tidy() {
  absl::MutexLock lock(&mu_);
  for (auto it = hashing_.begin(); it != hashing_.end();)
    it = it->second->digest().wait_for(std::chrono::seconds(0)) == std::future_status::ready ? hashing_.erase(it)
                                                                                             : std::next(it);
  const auto now = Clock::now();
  // Spares nobody took for a while give their memory back, all but each
  // head's newest: a trainer that updates less often than spare_idle_ (an
  // RL step of minutes) would otherwise write every update into a fresh
  // file, first-touching all its pages (1.5-4 s for 1.24 GB on the 2-core
  // VM, scoring slowed meanwhile). The memory bound counts two spares a
  // head (LmHeadStoreBytes).
  for (auto& [head, spares] : spares_) {
    if (spares.empty()) continue;
    // Spares are appended as they are released: the last is the newest.
    const auto newest = std::prev(spares.end());
    spares.erase(std::remove_if(spares.begin(), newest,
                                [&](const Spare& s) {
                                  if (now - s.since < spare_idle_) return false;
                                  unlink(s.path.c_str());
                                  return true;
                                }),
                 newest);
  }
}

int64_t LmHeadStore::BytesOf(const std::string& dir) {
  int64_t bytes = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    struct stat st {};
    if (lstat(entry.path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) bytes += static_cast<int64_t>(st.st_blocks) * 512;
  }
  return bytes;
}

int LmHeadStore::StagedFile(const std::string& head, const std::string& path, uint64_t size, FileMap* map) {
  Spare spare;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = spares_.find(head); it != spares_.end() && !it->second.empty()) {
      spare = std::move(it->second.back());  // the most recent: its pages are the likeliest in memory
      it->second.pop_back();
    }
  }
  if (!spare.path.empty()) {
    struct stat st {};
    if (stat(spare.path.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_size) == size &&
        rename(spare.path.c_str(), path.c_str()) == 0) {
      const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd >= 0) {
        LogLine() << absl::StrCat("logprob-server: lm_head ", head,
                                  ": the update writes into the store file a released version left (", size, " bytes)");
        *map = std::move(spare.map);  // its page tables still populated
        if (*map != nullptr) return fd;
        return MapStaged(fd, path, size, map);
      }
    }
    unlink(spare.path.c_str());  // another size (or gone): a new file
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  // Blocks allocated now: writes through the mapping never run out of space.
  if (fd < 0) return -1;
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    close(fd);
    unlink(path.c_str());
    errno = err;
    return -1;
  }
  return MapStaged(fd, path, size, map);
}

int LmHeadStore::MapStaged(int fd, const std::string& path, uint64_t size, FileMap* map) {
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (m == MAP_FAILED) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    errno = err;
    return -1;
  }
  *map = FileMap(static_cast<char*>(m), [size](char* q) { munmap(q, size); });
  return fd;
}

}  // namespace logprob
