#include "common/random_id.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace logprob {
namespace {

TEST(RandomIdTest, IsLowerCaseHexOfTwiceTheBytes) {
  for (const int bytes : {1, 4, 8, 16, 32}) {
    const std::string id = RandomId(bytes);
    EXPECT_EQ(id.size(), static_cast<size_t>(2 * bytes));
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
  }
  EXPECT_EQ(RandomId().size(), 32u);  // 128 bits by default
  EXPECT_EQ(RandomId(0), "");
}

TEST(RandomIdTest, DoesNotRepeat) {
  std::set<std::string> seen;
  for (int i = 0; i < 10000; ++i) EXPECT_TRUE(seen.insert(RandomId()).second);
}

TEST(RandomIdTest, UsesEveryHexDigit) {
  std::set<char> digits;
  for (int i = 0; i < 100; ++i)
    for (const char c : RandomId(16)) digits.insert(c);
  EXPECT_EQ(digits.size(), 16u);
}

}  // namespace
}  // namespace logprob
