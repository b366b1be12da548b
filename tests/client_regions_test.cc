// ClientRegions' proof of write access (server/inputs/client_regions.h,
// docs/security.md), without a server: a registration is unusable until
// the object holds its challenge; a wrong or missing proof removes it; the
// proof is read from the object opened at registration, not from whatever
// the name means later; one session's proof does not confirm another's.
// The live attack (a client that only knows the name) is in
// tests/server_shm_inputs_test.cc and the Python client's tests.
#include "server/inputs/client_regions.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace logprob {
namespace {

constexpr int64_t kSize = 4096;

/// A 0600 POSIX shared-memory object of this test, unlinked at the end.
class Object {
 public:
  explicit Object(int64_t bytes) : name_(absl::StrCat("/client-regions-test-", getpid(), "-", next_++)) {
    Create(bytes);
  }
  ~Object() { shm_unlink(name_.c_str()); }
  const std::string& name() const { return name_; }
  /// Writes `bytes` at `offset` through a new read-write descriptor.
  void Write(int64_t offset, const std::string& bytes) const {
    const int fd = shm_open(name_.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0) << name_ << ": " << std::strerror(errno);
    EXPECT_EQ(pwrite(fd, bytes.data(), bytes.size(), offset), static_cast<ssize_t>(bytes.size()));
    close(fd);
  }
  void Prove(const RegionChallenge& c) const { Write(c.proof_offset, c.challenge); }
  /// Unlinks the object and creates a new one of the same name.
  void Replace(int64_t bytes) {
    ASSERT_EQ(shm_unlink(name_.c_str()), 0);
    Create(bytes);
  }

 private:
  void Create(int64_t bytes) {
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << name_ << ": " << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    close(fd);
  }
  static inline int next_ = 0;
  std::string name_;
};

ClientRegions::Options Counted(int64_t* regions) {
  ClientRegions::Options o;
  o.on_change = [regions](int64_t n, int64_t) { *regions = n; };
  return o;
}

TEST(ClientRegionsProof, UnusableUntilTheObjectHoldsTheChallenge) {
  int64_t count = -1;
  ClientRegions regions(Counted(&count));
  Object obj(kSize + kProofBytes);
  auto c = regions.Register("a", "in", obj.name(), kSize);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->challenge.size(), static_cast<size_t>(kProofBytes));
  EXPECT_EQ(c->proof_offset, kSize) << "the object's last 32 bytes, past byte_size";
  EXPECT_EQ(count, 1) << "an unconfirmed region counts against the caps";
  const auto found = regions.Find("a", "in");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(found.status().message().find("\"in\" is not confirmed"), std::string::npos) << found.status();
  ASSERT_EQ(regions.List("a").size(), 1u);
  EXPECT_FALSE(regions.List("a")[0].confirmed);

  obj.Prove(*c);
  ASSERT_TRUE(regions.Confirm("a", "in").ok());
  EXPECT_TRUE(regions.Confirm("a", "in").ok()) << "confirming again is fine";
  ASSERT_TRUE(regions.Find("a", "in").ok());
  EXPECT_TRUE(regions.List("a")[0].confirmed);
}

TEST(ClientRegionsProof, AMissingOrWrongProofIsRefusedAndRemovesTheRegistration) {
  int64_t count = -1;
  ClientRegions regions(Counted(&count));
  Object obj(kSize + kProofBytes);
  auto c = regions.Register("a", "in", obj.name(), kSize);
  ASSERT_TRUE(c.ok()) << c.status();
  // Nothing written: the caller could only name the object.
  absl::Status st = regions.Confirm("a", "in");
  EXPECT_EQ(st.code(), absl::StatusCode::kPermissionDenied) << st;
  EXPECT_NE(st.message().find("\"in\""), std::string::npos) << st;
  EXPECT_NE(st.message().find(obj.name()), std::string::npos) << st;
  EXPECT_TRUE(regions.List("a").empty());
  EXPECT_EQ(count, 0);
  EXPECT_EQ(regions.Find("a", "in").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(regions.Confirm("a", "in").code(), absl::StatusCode::kNotFound);

  // A new registration has a new challenge; the old one does not prove it.
  auto again = regions.Register("a", "in", obj.name(), kSize);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->challenge, c->challenge);
  obj.Prove(*c);
  EXPECT_EQ(regions.Confirm("a", "in").code(), absl::StatusCode::kPermissionDenied);
  // Nor the challenge written at another offset (inside byte_size).
  again = regions.Register("a", "in", obj.name(), kSize);
  ASSERT_TRUE(again.ok()) << again.status();
  obj.Write(0, again->challenge);
  EXPECT_EQ(regions.Confirm("a", "in").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(count, 0);
}

TEST(ClientRegionsProof, TheProofIsReadFromTheObjectOpenedAtRegistration) {
  ClientRegions::Options o;
  ClientRegions regions(o);
  Object obj(kSize + kProofBytes);
  auto c = regions.Register("a", "in", obj.name(), kSize);
  ASSERT_TRUE(c.ok()) << c.status();
  // The name now means another object that holds the challenge: the
  // registered one does not, so the registration is not confirmed.
  obj.Replace(kSize + kProofBytes);
  obj.Prove(*c);
  EXPECT_EQ(regions.Confirm("a", "in").code(), absl::StatusCode::kPermissionDenied);

  // Confirmed, then replaced: reads still come from the confirmed object.
  c = regions.Register("a", "in", obj.name(), kSize);
  ASSERT_TRUE(c.ok()) << c.status();
  obj.Write(0, "confirmed object");
  obj.Prove(*c);
  ASSERT_TRUE(regions.Confirm("a", "in").ok());
  obj.Replace(kSize + kProofBytes);
  obj.Write(0, "another object!!");
  auto region = regions.Find("a", "in");
  ASSERT_TRUE(region.ok()) << region.status();
  char got[16];
  ASSERT_TRUE((*region)->Read(0, sizeof(got), got).ok());
  EXPECT_EQ(std::string(got, sizeof(got)), "confirmed object");
}

TEST(ClientRegionsProof, OneSessionsProofDoesNotConfirmAnothers) {
  ClientRegions::Options o;
  ClientRegions regions(o);
  Object obj(kSize + kProofBytes);
  auto mine = regions.Register("owner", "in", obj.name(), kSize);
  ASSERT_TRUE(mine.ok()) << mine.status();
  obj.Prove(*mine);
  ASSERT_TRUE(regions.Confirm("owner", "in").ok());
  // Another session names the same object; it cannot write it, and the
  // object holds the owner's challenge, not its own.
  auto theirs = regions.Register("other", "stolen", obj.name(), kSize);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_NE(theirs->challenge, mine->challenge);
  EXPECT_EQ(regions.Find("other", "stolen").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(regions.Confirm("other", "stolen").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(regions.Find("other", "stolen").status().code(), absl::StatusCode::kNotFound);
  // The owner's region is the owner's: not found from the other session.
  EXPECT_EQ(regions.Confirm("other", "in").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(regions.Find("other", "in").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(regions.Find("owner", "in").ok());
}

TEST(ClientRegionsProof, TheObjectMustHaveRoomForTheProofPastByteSize) {
  ClientRegions::Options o;
  ClientRegions regions(o);
  Object obj(kSize + kProofBytes - 1);
  const auto c = regions.Register("a", "in", obj.name(), kSize);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("proof of write access"), std::string::npos) << c.status();
  // A larger object: the proof is its last 32 bytes.
  Object big(3 * kSize);
  const auto b = regions.Register("a", "big", big.name(), kSize);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->proof_offset, 3 * kSize - kProofBytes);
}

TEST(ClientRegionsProof, AnObjectThatShrankBelowTheProofIsRefused) {
  ClientRegions::Options o;
  ClientRegions regions(o);
  Object obj(kSize + kProofBytes);
  auto c = regions.Register("a", "in", obj.name(), kSize);
  ASSERT_TRUE(c.ok()) << c.status();
  obj.Prove(*c);
  const int fd = shm_open(obj.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kSize), 0);
  close(fd);
  EXPECT_EQ(regions.Confirm("a", "in").code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace logprob
