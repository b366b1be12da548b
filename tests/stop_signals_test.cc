// StopSignals: the runs a worker was told to stop (Worker.Stop), whether
// the Stop comes before or after the run's items start.
#include "worker/stop_signals.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace logprob {
namespace {

TEST(StopSignals, RemembersStoppedRunsOnly) {
  StopSignals stops;
  EXPECT_FALSE(stops.Stopped(7));
  stops.Stop(7);  // before any item of run 7 asks
  EXPECT_TRUE(stops.Stopped(7));
  EXPECT_FALSE(stops.Stopped(8));
  stops.Stop(7);  // twice: still one entry
  EXPECT_TRUE(stops.Stopped(7));
}

TEST(StopSignals, KeepsTheLastCapacityRuns) {
  StopSignals stops(3);
  for (uint64_t id : {1, 2, 3, 3, 4}) stops.Stop(id);
  EXPECT_FALSE(stops.Stopped(1)) << "the oldest run is forgotten past the capacity";
  for (uint64_t id : {2, 3, 4}) EXPECT_TRUE(stops.Stopped(id)) << id;
}

TEST(StopSignals, ItemsPollingWhileStopsArriveSeeTheirRunStopped) {
  StopSignals stops(1 << 16);
  constexpr int kRuns = 2000;
  std::atomic<int> seen{0};
  std::vector<std::thread> pollers;
  for (int t = 0; t < 4; ++t)
    pollers.emplace_back([&, t] {
      for (uint64_t id = t; id < kRuns; id += 4) {
        while (!stops.Stopped(id)) std::this_thread::yield();
        seen.fetch_add(1);
      }
    });
  for (uint64_t id = 0; id < kRuns; ++id) stops.Stop(id);
  for (auto& p : pollers) p.join();
  EXPECT_EQ(seen.load(), kRuns);
}

}  // namespace
}  // namespace logprob
