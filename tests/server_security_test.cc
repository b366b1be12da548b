// TLS, mutual TLS and bearer-token auth of the public port, end to end:
// live servers with certificates made by the `openssl` command line (a CA,
// a server certificate for IP:127.0.0.1 and DNS:localhost, a client
// certificate, and an unrelated CA with its own client certificate) score
// the golden case basic_f32 for the clients they should accept and refuse
// the others; health stays open without a token; the CLI's security flags;
// bad server flags.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "client/health_check.h"
#include "common/channel.h"
#include "grpcpp/client_context.h"
#include "tests/test_support.h"

namespace logprob::testing {
namespace {

constexpr char kToken[] = "s3cret-Token_0123456789";
constexpr char kUpdateToken[] = "upd4te-Token_9876543210";

/// A channel with `options`, failing the test (null) when it cannot be made.
std::shared_ptr<grpc::Channel> Channel(const std::string& address, const client::ChannelOptions& options) {
  auto channel = client::MakeChannel(address, options);
  EXPECT_TRUE(channel.ok()) << channel.status();
  return channel.ok() ? *channel : nullptr;
}

/// Scores the basic_f32 golden case on `channel` (5 s deadline); on OK the
/// outputs must match the expected ones.
grpc::Status ScoreGolden(const std::shared_ptr<grpc::Channel>& channel, const std::string& extra_auth = "") {
  static const GoldenCase golden = LoadGolden("basic_f32");
  if (!channel) return grpc::Status(grpc::StatusCode::UNKNOWN, "no channel");
  auto stub = v1::LogprobService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (!extra_auth.empty()) ctx.AddMetadata("authorization", extra_auth);
  v1::ScoreResponse resp;
  const grpc::Status st = stub->Score(&ctx, GoldenRequest(golden), &resp);
  if (st.ok()) {
    EXPECT_EQ(
        CompareOutputs(golden.expected.tensors, std::vector<v1::Tensor>(resp.outputs().begin(), resp.outputs().end())),
        "");
  }
  return st;
}

class ServerSecurity : public ::testing::Test {
 protected:
  // Certificates and the token file, made once for the suite.
  static void SetUpTestSuite() {
    dir_ = new std::string(::testing::TempDir() + "/server_security_" + std::to_string(getpid()));
    std::filesystem::create_directories(*dir_);
    const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string d = *dir_ + "/";
    const std::vector<std::string> steps = {
        // The CA, and an unrelated one.
        "openssl req -x509" + ec + " -keyout " + d + "ca.key -out " + d + "ca.pem -days 2 -subj /CN=logprob-test-ca",
        "openssl req -x509" + ec + " -keyout " + d + "other_ca.key -out " + d +
            "other_ca.pem -days 2 -subj /CN=other-ca",
        // The server's certificate, signed by the CA.
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n' > " + d + "server.ext",
        "openssl req" + ec + " -keyout " + d + "server.key -out " + d + "server.csr -subj /CN=localhost",
        "openssl x509 -req -in " + d + "server.csr -CA " + d + "ca.pem -CAkey " + d +
            "ca.key -set_serial 2 -days 2 -extfile " + d + "server.ext -out " + d + "server.pem",
        // A client certificate from the CA, and one from the unrelated CA.
        "printf 'extendedKeyUsage=clientAuth\\n' > " + d + "client.ext",
        "openssl req" + ec + " -keyout " + d + "client.key -out " + d + "client.csr -subj /CN=client",
        "openssl x509 -req -in " + d + "client.csr -CA " + d + "ca.pem -CAkey " + d +
            "ca.key -set_serial 3 -days 2 -extfile " + d + "client.ext -out " + d + "client.pem",
        "openssl req" + ec + " -keyout " + d + "other_client.key -out " + d + "other_client.csr -subj /CN=client",
        "openssl x509 -req -in " + d + "other_client.csr -CA " + d + "other_ca.pem -CAkey " + d +
            "other_ca.key -set_serial 4 -days 2 -extfile " + d + "client.ext -out " + d + "other_client.pem",
    };
    for (const auto& cmd : steps) {
      const CommandResult r = RunCommand(cmd);
      ASSERT_EQ(r.code, 0) << cmd << "\n" << r.output;
    }
    std::ofstream(d + "token") << kToken << "\n";
    std::ofstream(d + "update_token") << kUpdateToken << "\n";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string File(const std::string& name) { return *dir_ + "/" + name; }

  static client::ChannelOptions Tls() {
    client::ChannelOptions o;
    o.tls_ca = File("ca.pem");
    return o;
  }
  static client::ChannelOptions Mtls() {
    client::ChannelOptions o = Tls();
    o.tls_cert = File("client.pem");
    o.tls_key = File("client.key");
    return o;
  }
  static std::vector<std::string> TlsFlags() {
    return {"--tls-cert", File("server.pem"), "--tls-key", File("server.key")};
  }
  /// Starts a 1-worker server with `flags`, waiting for health over a
  /// channel with `wait`.
  static std::unique_ptr<ServerProcess> StartServer(const std::vector<std::string>& flags,
                                                    const client::ChannelOptions& wait) {
    return ServerProcess::Start(1, flags, [wait](const std::string& address) { return Channel(address, wait); });
  }

  static std::string* dir_;
};
std::string* ServerSecurity::dir_ = nullptr;

TEST_F(ServerSecurity, TlsServesClientsTrustingItsCa) {
  auto server = StartServer(TlsFlags(), Tls());
  ASSERT_TRUE(server);
  const std::string addr = server->address();

  EXPECT_TRUE(ScoreGolden(Channel(addr, Tls())).ok());
  // The certificate also names localhost; the name to verify can be overridden.
  client::ChannelOptions by_name = Tls();
  by_name.tls_server_name = "localhost";
  EXPECT_TRUE(ScoreGolden(Channel(addr, by_name)).ok());

  EXPECT_EQ(ScoreGolden(client::MakeChannel(addr)).error_code(), grpc::StatusCode::UNAVAILABLE) << "plaintext client";
  client::ChannelOptions wrong_ca;
  wrong_ca.tls_ca = File("other_ca.pem");
  EXPECT_EQ(ScoreGolden(Channel(addr, wrong_ca)).error_code(), grpc::StatusCode::UNAVAILABLE) << "wrong CA";
  client::ChannelOptions wrong_name = Tls();
  wrong_name.tls_server_name = "not-the-server.example";
  EXPECT_EQ(ScoreGolden(Channel(addr, wrong_name)).error_code(), grpc::StatusCode::UNAVAILABLE) << "wrong name";
  EXPECT_TRUE(server->Alive());
}

TEST_F(ServerSecurity, MutualTlsRequiresAClientCertificateFromItsCa) {
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(), {"--tls-client-ca", File("ca.pem")});
  auto server = StartServer(flags, Mtls());
  ASSERT_TRUE(server);
  const std::string addr = server->address();

  EXPECT_TRUE(ScoreGolden(Channel(addr, Mtls())).ok());

  EXPECT_NE(ScoreGolden(Channel(addr, Tls())).error_code(), grpc::StatusCode::OK) << "no client certificate";
  client::ChannelOptions unrelated = Tls();
  unrelated.tls_cert = File("other_client.pem");
  unrelated.tls_key = File("other_client.key");
  EXPECT_NE(ScoreGolden(Channel(addr, unrelated)).error_code(), grpc::StatusCode::OK) << "client cert of another CA";
  EXPECT_NE(ScoreGolden(client::MakeChannel(addr)).error_code(), grpc::StatusCode::OK) << "plaintext client";
  // Health is behind mutual TLS too (it is the same port).
  EXPECT_FALSE(
      client::CheckHealth(Channel(addr, Tls()), std::chrono::system_clock::now() + std::chrono::seconds(3)).ok());
  EXPECT_TRUE(ScoreGolden(Channel(addr, Mtls())).ok()) << "still serving";
}

TEST_F(ServerSecurity, BearerTokenGuardsEveryLogprobServiceMethod) {
  auto server = ServerProcess::Start(1, {"--auth-token-file", File("token")});
  ASSERT_TRUE(server);  // Start's health wait carries no token: health is open.
  const std::string addr = server->address();
  const auto plain = client::MakeChannel(addr);

  // Score.
  const grpc::Status none = ScoreGolden(plain);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(none.error_message().find("bearer token"), std::string::npos) << none.error_message();
  const std::string right(kToken);
  std::string same_length = right;
  same_length.back() ^= 1;
  for (const std::string& bad : {"Bearer " + same_length, "Bearer " + right + "x", "Bearer " + right.substr(1),
                                 std::string("Bearer "), "Basic " + right, right, "Bearer  " + right}) {
    SCOPED_TRACE(bad);
    const grpc::Status st = ScoreGolden(plain, bad);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(st.error_message().find(right), std::string::npos) << "the token leaks: " << st.error_message();
  }
  EXPECT_TRUE(ScoreGolden(plain, "Bearer " + right).ok());
  EXPECT_TRUE(ScoreGolden(plain, "bearer " + right).ok()) << "the scheme is case-insensitive";
  client::ChannelOptions with_token;
  with_token.auth_token_file = File("token");  // ends in a newline, trimmed
  const auto authed = Channel(addr, with_token);
  EXPECT_TRUE(ScoreGolden(authed).ok());

  // GetServerInfo.
  auto stub = v1::LogprobService::NewStub(plain);
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_EQ(stub->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    const grpc::Status st = v1::LogprobService::NewStub(authed)->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(info.workers(), 1);
  }

  // ScoreStream: refused before any message is read.
  const GoldenCase golden = LoadGolden("basic_f32");
  for (const bool with : {false, true}) {
    SCOPED_TRACE(with ? "with token" : "without token");
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = v1::LogprobService::NewStub(with ? authed : plain)->ScoreStream(&ctx);
    stream->Write(GoldenRequest(golden));
    stream->WritesDone();
    v1::ScoreResponse resp;
    int responses = 0;
    while (stream->Read(&resp)) {
      ++responses;
      EXPECT_EQ(resp.status_code(), 0) << resp.status_message();
      EXPECT_EQ(CompareOutputs(golden.expected.tensors,
                               std::vector<v1::Tensor>(resp.outputs().begin(), resp.outputs().end())),
                "");
    }
    const grpc::Status st = stream->Finish();
    if (with) {
      EXPECT_TRUE(st.ok()) << st.error_message();
      EXPECT_EQ(responses, 1);
    } else {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
      EXPECT_EQ(responses, 0);
    }
  }

  // grpc.health.v1 needs no token.
  auto health = client::CheckHealth(plain, std::chrono::system_clock::now() + std::chrono::seconds(5));
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, client::ServingStatus::kServing);
}

// Separate rights (--update-token-file): the scoring token scores but
// cannot touch an update (PERMISSION_DENIED naming the method and the
// update right, before anything is looked up); no token is
// UNAUTHENTICATED; the update token updates (the CLI's --update-token-file)
// and may also score.
TEST_F(ServerSecurity, ScoringTokenCannotUpdateAndTheUpdateTokenCan) {
  const std::string head = GoldenDir() + "/hidden_bf16.lm_head.safetensors";
  auto server = ServerProcess::Start(1, {"--lm-head", head, "--allow-lm-head-updates", "--auth-token-file",
                                         File("token"), "--update-token-file", File("update_token")});
  ASSERT_TRUE(server);
  auto stub = v1::LogprobService::NewStub(client::MakeChannel(server->address()));
  const std::string scoring = std::string("Bearer ") + kToken, update = std::string("Bearer ") + kUpdateToken;
  auto begin = [&](const std::string& auth) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!auth.empty()) ctx.AddMetadata("authorization", auth);
    v1::BeginLmHeadUpdateRequest req;
    req.set_head("default");
    req.set_version("v2");
    req.set_vocab_size(1);  // the shape is checked after the right: a wrong one shows the right came first
    req.set_hidden_size(1);
    req.set_dtype(v1::BF16);
    v1::LmHeadUpdate resp;
    return stub->BeginLmHeadUpdate(&ctx, req, &resp);
  };
  const grpc::Status by_scoring = begin(scoring);
  EXPECT_EQ(by_scoring.error_code(), grpc::StatusCode::PERMISSION_DENIED) << by_scoring.error_message();
  EXPECT_NE(by_scoring.error_message().find("BeginLmHeadUpdate needs the update right"), std::string::npos)
      << by_scoring.error_message();
  const grpc::Status by_none = begin("");
  EXPECT_EQ(by_none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << by_none.error_message();
  EXPECT_NE(by_none.error_message().find("update right"), std::string::npos) << by_none.error_message();
  for (const grpc::Status& st : {by_scoring, by_none}) {
    EXPECT_EQ(st.error_message().find(kToken), std::string::npos) << st.error_message();
    EXPECT_EQ(st.error_message().find(kUpdateToken), std::string::npos) << st.error_message();
  }
  // The update token passes the right (the shape error comes next).
  EXPECT_EQ(begin(update).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  for (const char* method : {"Commit", "Abort"}) {
    SCOPED_TRACE(method);
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", scoring);
    v1::LmHeadUpdateRef ref;
    ref.set_update_id(std::string(32, 'a'));
    v1::LmHeadInfo info;
    v1::LmHeadUpdate upd;
    const grpc::Status st = std::string(method) == "Commit" ? stub->CommitLmHeadUpdate(&ctx, ref, &info)
                                                            : stub->AbortLmHeadUpdate(&ctx, ref, &upd);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
    EXPECT_NE(st.error_message().find(std::string(method) + "LmHeadUpdate needs the update right"), std::string::npos)
        << st.error_message();
  }

  // The CLI: the scoring token is refused (PutLmHeadRows never runs), the update token commits.
  const std::string update_cmd = BinDir() + "/logprob-client update-lm-head --server " + server->address() +
                                 " --head default --input " + head + " --version v2";
  const CommandResult refused = RunCommand(update_cmd + " --auth-token-file " + File("token"));
  EXPECT_EQ(refused.code, 1) << refused.output;
  EXPECT_NE(refused.output.find("needs the update right"), std::string::npos) << refused.output;
  const CommandResult committed = RunCommand(update_cmd + " --update-token-file " + File("update_token"));
  EXPECT_EQ(committed.code, 0) << committed.output;
  EXPECT_NE(committed.output.find("v2"), std::string::npos) << committed.output;

  // Both tokens score; none does not.
  EXPECT_TRUE(ScoreGolden(client::MakeChannel(server->address()), scoring).ok());
  EXPECT_TRUE(ScoreGolden(client::MakeChannel(server->address()), update).ok());
  EXPECT_EQ(ScoreGolden(client::MakeChannel(server->address())).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(ServerSecurity, CliScoresOverTlsWithAToken) {
  std::vector<std::string> flags = TlsFlags();
  flags.insert(flags.end(), {"--auth-token-file", File("token")});
  auto server = StartServer(flags, Tls());
  ASSERT_TRUE(server);
  const GoldenCase golden = LoadGolden("basic_f32");
  const std::string client = BinDir() + "/logprob-client ";
  const std::string out = File("basic_f32.out.safetensors");
  const std::string score = client + "score --server " + server->address() + " --input " + GoldenDir() +
                            "/basic_f32.safetensors --output " + out + CliOptionFlags(golden) + " --tls-ca " +
                            File("ca.pem");

  const CommandResult ok = RunCommand(score + " --auth-token-file " + File("token"));
  ASSERT_EQ(ok.code, 0) << ok.output;
  auto got = ReadSafetensors(out);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(CompareOutputs(golden.expected.tensors, got->tensors), "");

  std::filesystem::remove(out);
  const CommandResult no_token = RunCommand(score);
  EXPECT_EQ(no_token.code, 1) << no_token.output;
  EXPECT_TRUE(no_token.output.find("UNAUTHENTICATED") != std::string::npos ||
              no_token.output.find("bearer") != std::string::npos)
      << no_token.output;
  EXPECT_EQ(no_token.output.find(kToken), std::string::npos) << no_token.output;
  EXPECT_FALSE(std::filesystem::exists(out));

  const CommandResult plaintext =
      RunCommand(client + "score --server " + server->address() + " --input " + GoldenDir() +
                 "/basic_f32.safetensors --output " + out + " --auth-token-file " + File("token"));
  EXPECT_EQ(plaintext.code, 1) << plaintext.output;

  const CommandResult health =
      RunCommand(client + "health --server " + server->address() + " --wait 5 --tls-ca " + File("ca.pem"));
  EXPECT_EQ(health.code, 0) << health.output;
  const CommandResult missing_ca = RunCommand(score + "-missing");
  EXPECT_EQ(missing_ca.code, 2) << missing_ca.output;
  EXPECT_NE(missing_ca.output.find("--tls-ca"), std::string::npos) << missing_ca.output;
}

TEST_F(ServerSecurity, BadSecurityFlagsStopTheServer) {
  const std::string server =
      BinDir() + "/logprob-server --listen 127.0.0.1:" + std::to_string(FreePort()) + " --workers 1 --backend cpu ";
  std::ofstream(File("empty_token")).flush();
  struct Case {
    std::string flags;
    std::vector<std::string> message;  // every part must appear
  };
  const std::vector<Case> cases = {
      {"--tls-cert " + File("server.pem"), {"--tls-key"}},
      {"--tls_key " + File("server.key"), {"--tls-cert"}},
      {"--tls-client-ca " + File("ca.pem"), {"--tls-client-ca", "--tls-cert"}},
      {"--tls-cert " + File("nope.pem") + " --tls-key " + File("server.key"), {"--tls-cert", File("nope.pem")}},
      {"--tls-cert " + File("server.pem") + " --tls-key " + File("nope.key"), {"--tls-key", File("nope.key")}},
      {"--tls-cert " + File("server.pem") + " --tls-key " + File("client.key"), {"--tls-key", "does not match"}},
      {"--tls-cert " + File("server.key") + " --tls-key " + File("server.key"), {"--tls-cert", "no PEM certificate"}},
      {"--tls-cert " + File("server.pem") + " --tls-key " + File("server.key") + " --tls-client-ca " + File("nope.pem"),
       {"--tls-client-ca", File("nope.pem")}},
      {"--auth-token-file " + File("empty_token"), {"--auth-token-file", File("empty_token"), "empty"}},
      {"--auth-token-file " + File("nope"), {"--auth-token-file", File("nope")}},
      {"--update-token-file " + File("empty_token"), {"--update-token-file", File("empty_token"), "empty"}},
      {"--auth-token-file " + File("token") + " --update-token-file " + File("token"),
       {"--update-token-file", "holds the --auth-token-file token"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    const CommandResult r = RunCommand(server + c.flags);
    EXPECT_EQ(r.code, 1) << r.output;
    for (const std::string& part : c.message) EXPECT_NE(r.output.find(part), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace logprob::testing
