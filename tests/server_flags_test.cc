// logprob-server's flags read into ServerFlags and checked
// (server/app/server_flags.h), and what the wiring derives from them.
#include "server/app/server_flags.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/app/peer_sync_setup.h"
#include "server/app/startup_heads.h"

namespace logprob {
namespace {

/// The flags of one command line, parsed once per process (Abseil's usage
/// message may be set only once).
const ServerFlags& Parsed() {
  static const ServerFlags flags = [] {
    std::vector<std::string> args = {
        "logprob-server",     "--workers=3", "--lm-head", "a=/x.safetensors", "--lm-head=b=/y.safetensors",
        "--lm-head-frozen=a", "--max-topk=7"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return ParseServerFlags(static_cast<int>(argv.size()), argv.data());
  }();
  return flags;
}

TEST(ServerFlags, ParsedValuesKeepEveryRepeatedFlagAndTheDefaults) {
  const ServerFlags& f = Parsed();
  EXPECT_EQ(f.workers, 3);
  EXPECT_TRUE(f.workers_given);
  EXPECT_EQ(f.lm_heads, (std::vector<std::string>{"a=/x.safetensors", "b=/y.safetensors"}));
  EXPECT_EQ(f.lm_head_frozen, std::vector<std::string>{"a"});
  EXPECT_EQ(f.max_topk, 7);
  EXPECT_EQ(f.listen, "127.0.0.1:50051");
  EXPECT_EQ(f.keep_freed_memory_bytes, -1);
  EXPECT_EQ(f.lm_head_version, "initial");
}

TEST(ServerFlags, PoolChecksResolveTheKeptMemoryAndThePoolSize) {
  ServerFlags f = Parsed();
  ASSERT_TRUE(CheckPoolFlags(f).ok());
  EXPECT_EQ(f.keep_freed_memory_bytes, f.max_request_bytes);
  EXPECT_EQ(f.pool_workers, 3);

  ServerFlags cluster = Parsed();
  cluster.external_workers = 2;
  EXPECT_NE(std::string(CheckPoolFlags(cluster).message()).find("mutually exclusive"), std::string::npos);
  cluster.workers_given = false;
  cluster.control_listen = "0.0.0.0:50052";
  ASSERT_TRUE(CheckPoolFlags(cluster).ok());
  EXPECT_EQ(cluster.pool_workers, 2);

  ServerFlags none = Parsed();
  none.workers = 0;
  EXPECT_EQ(CheckPoolFlags(none).message(), "--workers must be >= 1");
  ServerFlags keep = Parsed();
  keep.keep_freed_memory_bytes = -2;
  EXPECT_EQ(CheckPoolFlags(keep).message(), "--keep-freed-memory-bytes must be >= 0, or -1 for --max-request-bytes");
}

TEST(ServerFlags, ServingChecksNameTheFlag) {
  ServerFlags ok = Parsed();
  ASSERT_TRUE(CheckPoolFlags(ok).ok());
  ASSERT_TRUE(CheckServingFlags(ok).ok());
  const auto message = [](void (*change)(ServerFlags&)) {
    ServerFlags f = Parsed();
    EXPECT_TRUE(CheckPoolFlags(f).ok());
    change(f);
    return std::string(CheckServingFlags(f).message());
  };
  EXPECT_EQ(message([](ServerFlags& f) { f.max_queue_delay = absl::Seconds(11); }),
            "--max-queue-delay must be in [0, 10s]");
  EXPECT_EQ(message([](ServerFlags& f) { f.lm_head_retain = 0; }), "--lm-head-retain must be >= 1");
  EXPECT_EQ(message([](ServerFlags& f) { f.lm_head_softcap = "abc"; }),
            "--lm-head-softcap abc: a number >= 0 (0: none) is needed");
  EXPECT_EQ(message([](ServerFlags& f) {
              f.lm_head_logit_scale = "2";
              f.lm_heads.clear();
            }),
            "--lm-head-logit-scale / --lm-head-softcap apply to an --lm-head; none is given");
  EXPECT_EQ(message([](ServerFlags& f) { f.lm_head_sync_from = "x:1"; }),
            "--lm-head-sync-from needs --allow-lm-head-updates (caught-up versions go through the update path)");
  EXPECT_NE(message([](ServerFlags& f) { f.parallelism_name = "rows"; }), "");
}

TEST(ServerFlags, TheScoringCoreAndTheWorkersGetTheCheckedValues) {
  ServerFlags f = Parsed();
  ASSERT_TRUE(CheckPoolFlags(f).ok());
  f.lm_head_softcap = "30";
  f.shared_memory_idle_timeout = absl::Seconds(2);
  ASSERT_TRUE(CheckServingFlags(f).ok());
  EXPECT_EQ(f.lm_head_scalars.softcap, 30.0);
  const ServiceConfig config = ServiceConfigFromFlags(f);
  EXPECT_EQ(config.limits.max_topk, 7);
  EXPECT_EQ(config.max_queue_delay, std::chrono::microseconds(2000));
  const InputResolverOptions inputs = InputResolverOptionsFromFlags(f, /*workers=*/1, /*same_host=*/true);
  EXPECT_EQ(inputs.shared_memory_regions.idle_timeout, std::chrono::milliseconds(2000));
  EXPECT_FALSE(inputs.cuda_ipc.available()) << "CPU workers";
  EXPECT_EQ(config.lm_head_precision(v1::BF16), "bf16");

  f.worker_threads = 0;
  EXPECT_GE(WorkerConfigFromFlags(f, /*payload_regions=*/false).threads(), 1);
  EXPECT_TRUE(WorkerConfigFromFlags(f, false).payload_region_prefix().empty());
  EXPECT_FALSE(WorkerConfigFromFlags(f, true).payload_region_prefix().empty());
  f.external_workers = 2;  // cluster: each worker uses its own cores
  EXPECT_EQ(WorkerConfigFromFlags(f, false).threads(), 0);
}

TEST(ServerFlags, LmHeadArgumentsAndPeerSync) {
  EXPECT_EQ(SplitLmHeadArg("policy=/no/such.safetensors"),
            (std::pair<std::string, std::string>{"policy", "/no/such.safetensors"}));
  EXPECT_EQ(SplitLmHeadArg("/no/such.safetensors"),
            (std::pair<std::string, std::string>{kDefaultLmHead, "/no/such.safetensors"}));
  ServerFlags f = Parsed();
  f.lm_head_sync_from = "dns:///peers:50051";
  f.lm_head_sync_timeout = absl::Seconds(90);
  const PeerSyncOptions sync = PeerSyncOptionsFromFlags(f);
  EXPECT_EQ(sync.target, "dns:///peers:50051");
  EXPECT_EQ(sync.pull_timeout, std::chrono::seconds(90));
  EXPECT_TRUE(sync.channel);
}

}  // namespace
}  // namespace logprob
