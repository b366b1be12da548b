// AdviseHugePages: the 2 MiB-aligned part of a range becomes eligible for
// transparent huge pages (what /proc/self/smaps says of its mapping).
#include "common/huge_pages.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace logprob {
namespace {

/// The system's THP mode ("always", "madvise", "never"), or "" if unknown.
std::string ThpMode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  const size_t b = line.find('['), e = line.find(']');
  return b == std::string::npos || e == std::string::npos ? "" : line.substr(b + 1, e - b - 1);
}

/// "THPeligible" of the mapping that contains `addr` in /proc/self/smaps
/// (-1 if not found).
int ThpEligible(uintptr_t addr) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= addr && addr < hi;
      continue;
    }
    if (inside && line.rfind("THPeligible:", 0) == 0) return std::stoi(line.substr(12));
  }
  return -1;
}

TEST(HugePages, TheAlignedPartOfALargeRangeBecomesEligible) {
  const std::string mode = ThpMode();
  if (mode != "madvise") GTEST_SKIP() << "THP mode \"" << mode << "\": the advice changes nothing to see";
  constexpr size_t kHuge = size_t{2} << 20, kBytes = 8 * kHuge;
  void* m = mmap(nullptr, kBytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  // A range that starts 16 bytes past a 2 MiB boundary (like malloc's).
  const uintptr_t base = (reinterpret_cast<uintptr_t>(m) + kHuge - 1) & ~uintptr_t{kHuge - 1};
  char* p = reinterpret_cast<char*>(base + 16);
  if (ThpEligible(base + kHuge) < 0) GTEST_SKIP() << "this kernel's smaps has no THPeligible";
  EXPECT_EQ(ThpEligible(base + kHuge), 0) << "not advised yet";
  AdviseHugePages(p, kBytes - 16);
  EXPECT_EQ(ThpEligible(base + kHuge), 1) << "the first whole 2 MiB page of the range";
  EXPECT_EQ(ThpEligible(base), 0) << "the 2 MiB page the range starts inside of is not advised";
  // Small ranges are left alone.
  void* small = mmap(nullptr, kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(small, MAP_FAILED);
  AdviseHugePages(small, kHuge);
  EXPECT_EQ(ThpEligible(reinterpret_cast<uintptr_t>(small)), 0);
  munmap(small, kHuge);
  munmap(m, kBytes + kHuge);
}

}  // namespace
}  // namespace logprob
