// The worker's payload regions (worker/scoring/payload_regions.h): a region the
// front-end retires (its SharedRegion is destroyed, which unlinks it) is
// unmapped by the worker at its next work item, once no item holds it.
#include "worker/scoring/payload_regions.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace logprob {
namespace {

/// True when this process maps the shared-memory object `name`.
bool Mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return text.str().find("/dev/shm" + name) != std::string::npos;
}

internal::v1::WorkItem ItemIn(const SharedRegion& region) {
  internal::v1::WorkItem item;
  item.mutable_shared_memory()->set_name(region.name());
  item.mutable_shared_memory()->set_offset(0);
  item.mutable_shared_memory()->set_byte_size(16);
  return item;
}

TEST(PayloadRegions, ARegionTheFrontEndRetiresIsUnmappedAtTheNextItemOnceFree) {
  PayloadRegions regions;
  auto first = SharedRegion::Create(size_t{1} << 20);
  auto second = SharedRegion::Create(size_t{1} << 20);
  ASSERT_TRUE(first.ok() && second.ok());
  const std::string name = (*first)->name();
  std::memcpy((*first)->data(), "payload-of-first", 16);
  std::shared_ptr<SharedRegion> hold;
  auto payload = regions.Payload(ItemIn(**first), &hold);
  ASSERT_TRUE(payload.ok()) << payload.status();
  EXPECT_EQ(*payload, "payload-of-first");
  hold.reset();
  EXPECT_EQ(regions.mapped(), 1u);

  first->reset();  // the front-end retires it: unmapped there, unlinked
  ASSERT_TRUE(Mapped(name)) << "the worker still maps it until its next item";
  std::shared_ptr<SharedRegion> hold2;
  ASSERT_TRUE(regions.Payload(ItemIn(**second), &hold2).ok());
  EXPECT_EQ(regions.mapped(), 1u);
  EXPECT_FALSE(Mapped(name)) << "a retired region stays mapped in the worker";
  EXPECT_TRUE(Mapped((*second)->name()));
}

TEST(PayloadRegions, ARetiredRegionAnItemStillHoldsStaysMappedUntilReleased) {
  PayloadRegions regions;
  auto region = SharedRegion::Create(size_t{1} << 20);
  ASSERT_TRUE(region.ok());
  const std::string name = (*region)->name();
  std::shared_ptr<SharedRegion> hold;
  ASSERT_TRUE(regions.Payload(ItemIn(**region), &hold).ok());
  region->reset();
  EXPECT_EQ(regions.ForgetRetired(), 1);
  EXPECT_EQ(regions.mapped(), 0u);
  EXPECT_TRUE(Mapped(name)) << "an item in flight still reads it";
  hold.reset();
  EXPECT_FALSE(Mapped(name));
}

}  // namespace
}  // namespace logprob
