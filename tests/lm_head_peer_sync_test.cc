// Reading a version back (ReadLmHeadVersion: the ReadLmHeadRows RPC's core)
// and resolving --lm-head-sync-from targets (ResolvePeerTarget). The whole
// catch-up between live front-ends is client/python/tests/test_replicas.py.
#include "server/transport/lm_head_peer_sync.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/lm_head_source.h"
#include "common/replica_target.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "server/heads/lm_head_reader.h"
#include "server/heads/lm_heads.h"

namespace logprob {
namespace {

constexpr int64_t kV = 37, kH = 8;

v1::Tensor F32Tensor(const std::string& name, const std::vector<int64_t>& shape, float first) {
  v1::Tensor t;
  t.set_name(name);
  t.set_dtype(v1::F32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = first + 0.25f * static_cast<float>(i);
  t.set_data(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  return t;
}

class ReadLmHeadVersionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = ::testing::TempDir() + "peer_sync_head." + std::to_string(getpid()) + ".safetensors";
    weight_ = F32Tensor("lm_head.weight", {kV, kH}, -3.0f);
    bias_ = F32Tensor("lm_head.bias", {kV}, 1.5f);
    ASSERT_TRUE(WriteSafetensors(path_, {weight_, bias_}).ok());
    auto source = ResolveLmHead(path_);
    ASSERT_TRUE(source.ok()) << source.status();
    LmHeadVersion v;
    v.head = "policy";
    v.version = "initial";
    v.source = *source;
    v.sha256 = KnownSha256("ab12");
    v.origin = path_;
    ASSERT_TRUE(heads_.Add(v).ok());
  }
  void TearDown() override { unlink(path_.c_str()); }

  /// The parts of a read (piece_bytes: 3 rows and a bit).
  absl::Status Read(const v1::ReadLmHeadRowsRequest& req, std::vector<v1::LmHeadRowsChunk>* parts) {
    return ReadLmHeadVersion(heads_, req, 3 * kH * 4 + 5, [parts](const v1::LmHeadRowsChunk& p) {
      parts->push_back(p);
      return true;
    });
  }

  std::string path_;
  v1::Tensor weight_, bias_;
  LmHeads heads_{LmHeads::Options{}};
};

TEST_F(ReadLmHeadVersionTest, GivesTheVersionThenItsRowsInOrderedPieces) {
  v1::ReadLmHeadRowsRequest req;
  req.set_head("policy");
  req.set_row_begin(5);
  req.set_row_end(20);
  std::vector<v1::LmHeadRowsChunk> parts;
  ASSERT_TRUE(Read(req, &parts).ok());
  ASSERT_EQ(parts.size(), 1u + 5u);  // 15 rows, 3 per piece
  ASSERT_TRUE(parts[0].has_version());
  const v1::LmHeadVersionRows& head = parts[0].version();
  EXPECT_EQ(head.info().name(), "policy");
  EXPECT_EQ(head.info().version(), "initial");
  EXPECT_EQ(head.info().sha256(), "ab12");
  EXPECT_EQ(head.info().vocab_size(), kV);
  EXPECT_EQ(head.info().hidden_size(), kH);
  EXPECT_EQ(head.info().dtype(), v1::F32);
  EXPECT_TRUE(head.info().has_bias());
  EXPECT_EQ(head.info().committed_unix_ms(), 0);  // loaded at start
  EXPECT_EQ(head.row_begin(), 5);
  EXPECT_EQ(head.row_end(), 20);
  EXPECT_EQ(head.bias().dtype(), v1::F32);
  EXPECT_EQ(head.bias().data(), bias_.data());
  std::string rows;
  for (size_t i = 1; i < parts.size(); ++i) {
    ASSERT_TRUE(parts[i].has_piece());
    EXPECT_EQ(parts[i].piece().tensor(), 0);
    EXPECT_EQ(parts[i].piece().offset(), static_cast<int64_t>(rows.size()));
    rows += parts[i].piece().data();
  }
  EXPECT_EQ(rows, weight_.data().substr(5 * kH * 4, 15 * kH * 4));
}

TEST_F(ReadLmHeadVersionTest, RefusesBadRequestsAndStopsForAGoneCaller) {
  std::vector<v1::LmHeadRowsChunk> parts;
  v1::ReadLmHeadRowsRequest req;
  req.set_head("policy");
  req.set_row_end(kV + 1);
  EXPECT_EQ(Read(req, &parts).code(), absl::StatusCode::kInvalidArgument);
  req.set_row_end(0);
  req.set_row_begin(-1);
  EXPECT_EQ(Read(req, &parts).code(), absl::StatusCode::kInvalidArgument);
  req.set_row_begin(0);
  req.set_version("gone");
  EXPECT_EQ(Read(req, &parts).code(), absl::StatusCode::kFailedPrecondition);
  req.set_version("bad/name");
  EXPECT_EQ(Read(req, &parts).code(), absl::StatusCode::kInvalidArgument);
  req.clear_version();
  req.set_head("nope");
  EXPECT_EQ(Read(req, &parts).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(parts.empty());
  req.set_head("policy");
  int written = 0;
  absl::Status st = ReadLmHeadVersion(heads_, req, 1 << 20, [&written](const v1::LmHeadRowsChunk&) {
    ++written;
    return false;
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(written, 1);
}

TEST(ResolvePeerTargetTest, EveryAddressBehindATarget) {
  using V = std::vector<std::string>;
  EXPECT_EQ(ResolvePeerTarget("ipv4:127.0.0.1:1,127.0.0.1:2").value(), (V{"127.0.0.1:1", "127.0.0.1:2"}));
  EXPECT_EQ(ResolvePeerTarget("dns:///127.0.0.1:5").value(), (V{"127.0.0.1:5"}));
  EXPECT_EQ(ResolvePeerTarget("dns:127.0.0.1:5,127.0.0.1:5,[::1]:6").value(), (V{"127.0.0.1:5", "[::1]:6"}));
  const V local = ResolvePeerTarget("localhost:7").value();
  EXPECT_NE(std::find(local.begin(), local.end(), "127.0.0.1:7"), local.end());
  // No peer yet (a headless Service lists no pod): no address, no error.
  EXPECT_TRUE(ResolvePeerTarget("dns:///nonexistent.invalid:1").value().empty());
  for (const char* bad : {"a", "a:", "a:0", "a:70000", "unix:/tmp/x", ":5"})
    EXPECT_EQ(ResolvePeerTarget(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
}

// The grammar's cases, which the Python client's resolve_replicas is tested
// against too (client/python/tests/test_replicas.py).
TEST(ReplicaTargetGolden, ParseGivesEveryCasesKindAndAddressesOrRefusesIt) {
  std::ifstream in(std::string(LOGPROB_REPLICA_TARGETS_GOLDEN));
  ASSERT_TRUE(in.good()) << LOGPROB_REPLICA_TARGETS_GOLDEN;
  const nlohmann::json golden = nlohmann::json::parse(in);
  const std::map<std::string, ReplicaTarget::Kind> kinds = {{"listed", ReplicaTarget::Kind::kListed},
                                                            {"dns", ReplicaTarget::Kind::kDns},
                                                            {"plain", ReplicaTarget::Kind::kPlain}};
  ASSERT_GE(golden.at("cases").size(), 10u);
  for (const nlohmann::json& c : golden.at("cases")) {
    const std::string target = c.at("target").get<std::string>();
    const absl::StatusOr<ReplicaTarget> parsed = ParseReplicaTarget(target, "--lm-head-sync-from");
    if (c.value("error", false)) {
      EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << "\"" << target << "\"";
      continue;
    }
    ASSERT_TRUE(parsed.ok()) << "\"" << target << "\": " << parsed.status();
    EXPECT_EQ(parsed->kind, kinds.at(c.at("kind").get<std::string>())) << target;
    EXPECT_EQ(parsed->addresses, c.at("addresses").get<std::vector<std::string>>()) << target;
  }
}

}  // namespace
}  // namespace logprob
