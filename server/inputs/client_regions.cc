#include "server/inputs/client_regions.h"

#include <fcntl.h>
#include <sys/mman.h>  // shm_open
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/error_reason.h"
#include "common/mapped_file_copy.h"
#include "openssl/crypto.h"  // CRYPTO_memcmp
#include "openssl/rand.h"

namespace logprob {
namespace {

bool NameChars(const std::string& s, size_t from) {
  for (size_t i = from; i < s.size(); ++i) {
    const char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
          c == '-'))
      return false;
  }
  return true;
}

absl::Status CheckNames(const std::string& name, const std::string& shm_name, int64_t byte_size) {
  if (name.empty() || name.size() > 128 || !NameChars(name, 0))
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory region name \"", name, "\" must be 1..128 of [A-Za-z0-9._-]"));
  if (shm_name.size() < 2 || shm_name.size() > 251 || shm_name[0] != '/' || !NameChars(shm_name, 1) ||
      shm_name == "/." || shm_name == "/..")
    return absl::InvalidArgumentError(
        absl::StrCat("shm_name \"", shm_name, "\" must be \"/\" followed by 1..250 of [A-Za-z0-9._-]"));
  // The front-end's own payload regions (SharedRegion::Create:
  // /logprob-<pid>-<n>) hold other clients' tensors.
  int pid = 0;
  char rest = 0;
  if (std::sscanf(shm_name.c_str(), "/logprob-%d%c", &pid, &rest) >= 1)
    return absl::PermissionDeniedError(absl::StrCat("shm_name \"", shm_name, "\" is a server payload region"));
  if (byte_size <= 0)
    return absl::InvalidArgumentError(absl::StrCat("byte_size of region \"", name, "\" must be > 0, got ", byte_size));
  return absl::OkStatus();
}

/// NOT_FOUND, reason SHARED_MEMORY_REGION_NOT_REGISTERED: the session holds
/// no region `name` (never registered, unregistered, or expired with an
/// idle session or a restarted server); `hint` ends the message.
absl::Status NotRegistered(const std::string& name, const std::string& hint = "") {
  return WithReason(
      absl::NotFoundError(absl::StrCat("shared-memory region \"", name, "\" is not registered by this session", hint)),
      v1::SHARED_MEMORY_REGION_NOT_REGISTERED);
}

/// `st` (an error opening the client's object), reason
/// SHARED_MEMORY_UNAVAILABLE: this server cannot use the client's object
/// (not visible here, another uid): the client sends the bytes inline.
absl::Status Unusable(absl::Status st) { return WithReason(std::move(st), v1::SHARED_MEMORY_UNAVAILABLE); }

}  // namespace

absl::StatusOr<std::shared_ptr<const ClientRegion>> ClientRegion::Open(const std::string& name,
                                                                       const std::string& shm_name, int64_t byte_size) {
  if (auto st = CheckNames(name, shm_name, byte_size); !st.ok()) return st;
  const int fd = shm_open(shm_name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat("shm_open ", shm_name, ": ", std::strerror(err));
    if (err == ENOENT) return Unusable(absl::NotFoundError(msg));
    if (err == EACCES || err == ELOOP) return Unusable(absl::PermissionDeniedError(msg));
    return absl::InternalError(msg);
  }
  struct stat st;
  absl::Status bad;
  if (fstat(fd, &st) != 0) {
    bad = absl::InternalError(absl::StrCat("fstat ", shm_name, ": ", std::strerror(errno)));
  } else if (!S_ISREG(st.st_mode)) {
    bad = absl::PermissionDeniedError(absl::StrCat(shm_name, " is not a regular shared-memory object"));
  } else if (st.st_uid != geteuid()) {
    bad = Unusable(absl::PermissionDeniedError(
        absl::StrCat(shm_name, " is owned by uid ", st.st_uid, ", not by the server's uid ", geteuid())));
  } else if (st.st_size - kProofBytes < byte_size) {
    bad = absl::InvalidArgumentError(absl::StrCat("region \"", name, "\": ", shm_name, " holds ", st.st_size,
                                                  " bytes, fewer than byte_size ", byte_size, " + ", kProofBytes,
                                                  " (the proof of write access, past byte_size)"));
  }
  if (!bad.ok()) {
    close(fd);
    return bad;
  }
  // Mapped once for every later read (CopyFromMappedFile); without a
  // mapping every read is a pread.
  void* map = mmap(nullptr, static_cast<size_t>(byte_size), PROT_READ, MAP_SHARED, fd, 0);
  return std::shared_ptr<const ClientRegion>(
      new ClientRegion(name, shm_name, byte_size, static_cast<int64_t>(st.st_size) - kProofBytes, fd,
                       map == MAP_FAILED ? nullptr : static_cast<const char*>(map)));
}

bool ClientRegion::HoldsProof(const std::string& challenge) const {
  if (challenge.size() != static_cast<size_t>(kProofBytes)) return false;
  char got[kProofBytes];
  size_t done = 0;
  while (done < sizeof(got)) {
    const ssize_t n = pread(fd_, got + done, sizeof(got) - done, static_cast<off_t>(proof_offset_ + done));
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return false;  // shrunk below the proof, or an error
    }
  }
  return CRYPTO_memcmp(got, challenge.data(), sizeof(got)) == 0;
}

ClientRegion::~ClientRegion() {
  if (map_ != nullptr) munmap(const_cast<char*>(map_), static_cast<size_t>(byte_size_));
  close(fd_);
}

absl::Status ClientRegion::Read(int64_t offset, size_t n, char* dst) const {
  // A SIGBUS (the object shrank) fails the copy: pread then says how.
  if (map_ != nullptr && offset >= 0 && static_cast<uint64_t>(offset) <= static_cast<uint64_t>(byte_size_) &&
      n <= static_cast<uint64_t>(byte_size_ - offset) && CopyFromMappedFile(dst, map_ + offset, n))
    return absl::OkStatus();
  return ReadWithPread(offset, n, dst);
}

absl::Status ClientRegion::ReadWithPread(int64_t offset, size_t n, char* dst) const {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = pread(fd_, dst + done, n - done, static_cast<off_t>(offset + done));
    if (got > 0) {
      done += static_cast<size_t>(got);
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    const int err = got < 0 ? errno : 0;
    std::memset(dst + done, 0, n - done);
    struct stat st;
    const int64_t now = fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory region \"", name_, "\" (", shm_name_, ") changed while the request was in flight: bytes [",
        offset + done, ", ", offset + n, ") could not be read (the object is now ", now, " bytes",
        err ? absl::StrCat("; ", std::strerror(err)) : "", ")"));
  }
  return absl::OkStatus();
}

ClientRegions::ClientRegions(Options options) : options_(std::move(options)) {
  reaper_ = std::thread([this] {
    const auto period = absl::FromChrono(std::max(std::chrono::milliseconds(10), options_.idle_timeout / 4));
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (!stop_) cv_.WaitWithTimeout(&mu_, period);
        if (stop_) return;
      }
      ExpireIdle(std::chrono::steady_clock::now());
    }
  });
}

ClientRegions::~ClientRegions() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  reaper_.join();
}

void ClientRegions::Changed() {
  if (options_.on_change) options_.on_change(regions_, bytes_);
}

absl::StatusOr<RegionChallenge> ClientRegions::Register(const std::string& owner, const std::string& name,
                                                        const std::string& shm_name, int64_t byte_size) {
  if (auto st = CheckNames(name, shm_name, byte_size); !st.ok()) return st;
  {
    absl::MutexLock lock(&mu_);
    Session& s = sessions_[owner];
    s.last_used = std::chrono::steady_clock::now();
    if (s.regions.count(name))
      return absl::AlreadyExistsError(absl::StrCat("shared-memory region \"", name, "\" is already registered"));
  }
  // Opened without the lock (a system call); the caps are checked again below.
  auto region = ClientRegion::Open(name, shm_name, byte_size);
  if (!region.ok()) return region.status();
  RegionChallenge out;
  out.challenge.resize(kProofBytes);
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.challenge.data()), kProofBytes) != 1)
    return absl::InternalError("no random bytes for the shared-memory challenge (RAND_bytes)");
  out.proof_offset = (*region)->proof_offset();
  absl::MutexLock lock(&mu_);
  Session& s = sessions_[owner];
  s.last_used = std::chrono::steady_clock::now();
  if (s.regions.count(name))
    return absl::AlreadyExistsError(absl::StrCat("shared-memory region \"", name, "\" is already registered"));
  if (regions_ + 1 > options_.max_regions)
    return absl::ResourceExhaustedError(absl::StrCat("the server holds its maximum of ", options_.max_regions,
                                                     " shared-memory regions (--max-shared-memory-regions)"));
  if (bytes_ + byte_size > options_.max_bytes)
    return absl::ResourceExhaustedError(absl::StrCat("registering ", byte_size,
                                                     " bytes would exceed the server's --max-shared-memory-bytes ",
                                                     options_.max_bytes, " (", bytes_, " registered)"));
  s.regions[name] = Entry{*std::move(region), out.challenge, false};
  ++regions_;
  bytes_ += byte_size;
  Changed();
  return out;
}

absl::Status ClientRegions::Confirm(const std::string& owner, const std::string& name) {
  const absl::Status not_found = NotRegistered(name);
  std::shared_ptr<const ClientRegion> region;
  std::string challenge;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(owner);
    if (it == sessions_.end()) return not_found;
    it->second.last_used = std::chrono::steady_clock::now();
    auto r = it->second.regions.find(name);
    if (r == it->second.regions.end()) return not_found;
    if (r->second.confirmed) return absl::OkStatus();
    region = r->second.region;
    challenge = r->second.challenge;
  }
  // Read without the lock (a system call), through the registration's own descriptor.
  const bool proven = region->HoldsProof(challenge);
  std::shared_ptr<const ClientRegion> gone;  // closed after the lock
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(owner);
  if (it == sessions_.end()) return not_found;
  auto r = it->second.regions.find(name);
  // Unregistered (and perhaps registered anew) meanwhile: that registration has its own challenge.
  if (r == it->second.regions.end() || r->second.region != region) return not_found;
  if (proven) {
    r->second.confirmed = true;
    r->second.challenge.clear();
    return absl::OkStatus();
  }
  gone = std::move(r->second.region);
  it->second.regions.erase(r);
  --regions_;
  bytes_ -= gone->byte_size();
  Changed();
  return absl::PermissionDeniedError(
      absl::StrCat("shared-memory region \"", name, "\" (", gone->shm_name(),
                   "): the registration's challenge is not at offset ", gone->proof_offset(),
                   " of the object: only a process that can write the object may register it "
                   "(RegisterSharedMemory answers the challenge to write there); the registration is removed"));
}

absl::StatusOr<int> ClientRegions::Unregister(const std::string& owner, const std::string& name) {
  std::vector<std::shared_ptr<const ClientRegion>> gone;  // closed after the lock
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(owner);
  if (it != sessions_.end()) it->second.last_used = std::chrono::steady_clock::now();
  if (name.empty()) {
    if (it == sessions_.end()) return 0;
    for (auto& [n, e] : it->second.regions) gone.push_back(e.region);
    it->second.regions.clear();
  } else {
    const absl::Status not_found = NotRegistered(name);
    if (it == sessions_.end()) return not_found;
    auto r = it->second.regions.find(name);
    if (r == it->second.regions.end()) return not_found;
    gone.push_back(r->second.region);
    it->second.regions.erase(r);
  }
  for (const auto& r : gone) {
    --regions_;
    bytes_ -= r->byte_size();
  }
  if (!gone.empty()) Changed();
  return static_cast<int>(gone.size());
}

std::vector<ClientRegions::Listed> ClientRegions::List(const std::string& owner) {
  absl::MutexLock lock(&mu_);
  std::vector<Listed> out;
  auto it = sessions_.find(owner);
  if (it == sessions_.end()) return out;
  it->second.last_used = std::chrono::steady_clock::now();
  for (const auto& [n, e] : it->second.regions) out.push_back({e.region, e.confirmed});
  return out;
}

absl::StatusOr<std::shared_ptr<const ClientRegion>> ClientRegions::Find(const std::string& owner,
                                                                        const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(owner);
  if (it != sessions_.end()) {
    it->second.last_used = std::chrono::steady_clock::now();
    auto r = it->second.regions.find(name);
    if (r != it->second.regions.end()) {
      if (r->second.confirmed) return r->second.region;
      return absl::PermissionDeniedError(
          absl::StrCat("shared-memory region \"", name,
                       "\" is not confirmed: write the registration's challenge into the object and call "
                       "ConfirmSharedMemory first (only a process that can write the object may use it)"));
    }
  }
  return NotRegistered(name, " (RegisterSharedMemory first; regions of idle sessions expire)");
}

std::shared_ptr<void> ClientRegions::Hold(const std::string& owner) {
  {
    absl::MutexLock lock(&mu_);
    ++sessions_[owner].in_flight;
  }
  return std::shared_ptr<void>(nullptr, [this, owner](void*) {
    absl::MutexLock lock(&mu_);
    Session& s = sessions_[owner];
    --s.in_flight;
    s.last_used = std::chrono::steady_clock::now();
  });
}

int ClientRegions::ExpireIdle(std::chrono::steady_clock::time_point now) {
  std::vector<std::shared_ptr<const ClientRegion>> gone;  // closed after the lock
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second.in_flight > 0 || now - it->second.last_used < options_.idle_timeout) {
      ++it;
      continue;
    }
    for (auto& [n, e] : it->second.regions) gone.push_back(e.region);
    it = sessions_.erase(it);
  }
  for (const auto& r : gone) {
    --regions_;
    bytes_ -= r->byte_size();
  }
  if (!gone.empty()) Changed();
  return static_cast<int>(gone.size());
}

}  // namespace logprob
