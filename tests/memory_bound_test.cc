// The front-end's memory bound (server/app/memory_bound.h) from its limits,
// the payload pool's byte cap it counts on, and the memory gauges read at
// scrape time (server/metrics/memory_metrics.h).
#include "server/app/memory_bound.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "server/metrics/memory_metrics.h"
#include "server/pool/payload_pool.h"

namespace logprob {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(FrontendMemoryBound, EachPartFollowsFromItsLimit) {
  const FrontendMemoryBound local = ComputeFrontendMemoryBound(
      {/*max_queue_bytes=*/2048 * kMiB, /*max_request_bytes=*/600 * kMiB, /*keep_freed_bytes=*/600 * kMiB,
       /*payload_regions=*/true});
  EXPECT_EQ(local.base, 64 * kMiB);
  EXPECT_EQ(local.requests, 3072 * kMiB);       // 1.5 x the queue
  EXPECT_EQ(local.payloads, 4096 * kMiB);       // 2 x the queue, power-of-two regions
  EXPECT_EQ(local.idle_payloads, 1024 * kMiB);  // the pool's cap: RegionSize(600 MiB)
  EXPECT_EQ(local.chunk_buffers, 600 * kMiB);
  EXPECT_EQ(local.kept_freed, 600 * kMiB);
  EXPECT_EQ(local.total(), (64 + 3072 + 4096 + 1024 + 600 + 600) * kMiB);
  EXPECT_EQ(local.Describe(),
            "9456 MiB (base 64 MiB, requests 3072 MiB, payload regions 4096 MiB + 1024 MiB idle, chunk buffers "
            "600 MiB, kept freed 600 MiB)");
  // External workers get their payloads inline: no payload regions.
  const FrontendMemoryBound external =
      ComputeFrontendMemoryBound({2048 * kMiB, 600 * kMiB, 0, /*payload_regions=*/false});
  EXPECT_EQ(external.payloads, 0);
  EXPECT_EQ(external.idle_payloads, 0);
  EXPECT_EQ(external.total(), (64 + 3072 + 600) * kMiB);
  // Updates: the store files (retain + 3 of each updatable head's weight, in pages).
  EXPECT_EQ(LmHeadStoreBytes(256 * kMiB, 1), 4 * (256 * kMiB + 4096));
  EXPECT_EQ(LmHeadStoreBytes(4097, 2), 5 * 3 * 4096);
  FrontendMemoryLimits updates{2048 * kMiB, 600 * kMiB, 0, false};
  updates.lm_head_store_bytes = 1024 * kMiB;
  const FrontendMemoryBound with_store = ComputeFrontendMemoryBound(updates);
  EXPECT_EQ(with_store.lm_head_store, 1024 * kMiB);
  EXPECT_EQ(with_store.total(), (64 + 3072 + 600 + 1024) * kMiB);
  EXPECT_EQ(with_store.Describe(),
            "4760 MiB (base 64 MiB, requests 3072 MiB, payload regions 0 MiB + 0 MiB idle, chunk buffers 600 MiB, kept "
            "freed 0 MiB, lm_head store 1024 MiB)");
}

TEST(PayloadPool, IdleRegionsStayWithinTheByteCapKeepingTheLargest) {
  EXPECT_EQ(PayloadPool::RegionSize(1), static_cast<size_t>(kMiB));
  EXPECT_EQ(PayloadPool::RegionSize(3 * kMiB), static_cast<size_t>(4 * kMiB));
  PayloadPool pool(/*max_idle=*/4, /*max_idle_bytes=*/5 * kMiB);
  {
    std::vector<std::shared_ptr<SharedRegion>> held;
    for (int64_t mib : {1, 2, 4}) {
      auto region = pool.Acquire(static_cast<size_t>(mib * kMiB));
      ASSERT_TRUE(region.ok()) << region.status();
      held.push_back(*std::move(region));
    }
    EXPECT_EQ(pool.idle_bytes(), 0);
  }
  // 7 MiB came back: the 1 and 2 MiB regions go, the 4 MiB one stays.
  EXPECT_EQ(pool.idle_bytes(), 4 * kMiB);
  auto again = pool.Acquire(3 * kMiB);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->size(), static_cast<size_t>(4 * kMiB));
  EXPECT_EQ(pool.idle_bytes(), 0);
  // A region larger than the cap is not kept.
  { ASSERT_TRUE(pool.Acquire(8 * kMiB).ok()); }
  EXPECT_EQ(pool.idle_bytes(), 0);
}

/// {family name: {label value (or ""): value}} of a collection.
std::map<std::string, std::map<std::string, double>> Values(const std::vector<prometheus::MetricFamily>& families) {
  std::map<std::string, std::map<std::string, double>> out;
  for (const auto& f : families)
    for (const auto& m : f.metric) out[f.name][m.label.empty() ? "" : m.label[0].value] = m.gauge.value;
  return out;
}

TEST(MemoryMetrics, PoolsAreReadAtScrapeTimeUntilTheirRegistrationGoes) {
  MemoryMetrics memory;
  int64_t chunk = 3 * kMiB;
  auto chunk_gauge = memory.AddPool("chunk_buffers", [&chunk] { return chunk; });
  auto payload_gauge = memory.AddPool("payload_regions", [] { return 8 * kMiB; });
  memory.SetBound(100 * kMiB);
  auto v = Values(memory.Collect());
  EXPECT_EQ(v["logprob_pooled_bytes"]["chunk_buffers"], 3 * kMiB);
  EXPECT_EQ(v["logprob_pooled_bytes"]["payload_regions"], 8 * kMiB);
  EXPECT_EQ(v["logprob_memory_bound_bytes"][""], 100 * kMiB);
  EXPECT_GT(v["process_resident_memory_bytes"][""], 0);
  EXPECT_EQ(v.count("logprob_kept_freed_bytes"), 1u);
  chunk = 5 * kMiB;
  payload_gauge.reset();
  v = Values(memory.Collect());
  EXPECT_EQ(v["logprob_pooled_bytes"]["chunk_buffers"], 5 * kMiB);
  EXPECT_EQ(v["logprob_pooled_bytes"].count("payload_regions"), 0u);
}

}  // namespace
}  // namespace logprob
