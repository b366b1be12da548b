// Printable (names in logs and errors: escaped, cut) and ToGrpc's cut of
// long status messages (issue 32 finding 7).
#include "common/untrusted_text.h"

#include <gtest/gtest.h>

#include <string>

#include "common/grpc_status.h"
#include "server/heads/lm_heads.h"

namespace logprob {
namespace {

TEST(SecurityNames, PrintableEscapesControlBytesAndCutsLongText) {
  EXPECT_EQ(Printable("policy-v1.2:3+4"), "policy-v1.2:3+4");
  EXPECT_EQ(Printable(std::string("a\nb\0c\x1b\"", 7)), "a\\nb\\x00\\x63\\x1b\\\"");
  EXPECT_EQ(Printable(std::string(10240, 'v'), 8), "vvvvvvvv...(10240 bytes)");
  EXPECT_EQ(Printable("\n\n\n\n", 2), "\\n\\n...(4 bytes)");
}

TEST(SecurityNames, NameChecksEchoEscapedAndCut) {
  const absl::Status head = CheckLmHeadName(std::string(10240, 'h'), "head");
  EXPECT_EQ(head.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(head.message().size(), 200u) << head.message();
  EXPECT_NE(head.message().find("...(10240 bytes)"), std::string::npos) << head.message();
  const absl::Status version = CheckLmHeadVersionName("v1\nlogprob-server: forged", "version");
  EXPECT_EQ(version.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(version.message().find('\n'), std::string::npos) << version.message();
  EXPECT_NE(version.message().find("version \"v1\\nlogprob-server: forged\""), std::string::npos) << version.message();
  EXPECT_EQ(CheckLmHeadVersionName(std::string("v\0", 2), "version").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckLmHeadVersionName(std::string(128, 'v'), "version").ok());
  EXPECT_FALSE(CheckLmHeadVersionName(std::string(129, 'v'), "version").ok());
  EXPECT_TRUE(CheckLmHeadName(std::string(64, 'h'), "head").ok());
  EXPECT_FALSE(CheckLmHeadName(std::string(65, 'h'), "head").ok());
}

TEST(SecurityNames, NoControlByteReachesAClientsStatusMessage) {
  EXPECT_EQ(EscapeControlBytes("plain \"text\" \\ ok"), "plain \"text\" \\ ok");
  EXPECT_EQ(EscapeControlBytes(std::string("a\nb\0c\x1b[31md\x7f", 12)), "a\\x0ab\\x00c\\x1b[31md\\x7f");
  EXPECT_EQ(EscapeControlBytes("caf\xc3\xa9"), "caf\xc3\xa9");  // UTF-8 kept
  // Whatever a message holds (a tensor name, a region name, a sha256 sent
  // raw), the status a client gets has no raw LF, ESC or NUL.
  const grpc::Status st =
      ToGrpc(absl::InvalidArgumentError(std::string("inputs[0] \"x\nlogprob-server: forged\x1b[2J\0\": bad", 46)));
  EXPECT_EQ(st.error_message().find('\n'), std::string::npos) << st.error_message();
  EXPECT_EQ(st.error_message().find('\x1b'), std::string::npos) << st.error_message();
  EXPECT_EQ(st.error_message().find('\0'), std::string::npos) << st.error_message();
  EXPECT_NE(st.error_message().find("x\\x0alogprob-server: forged\\x1b[2J\\x00"), std::string::npos)
      << st.error_message();
}

TEST(SecurityNames, LongStatusMessagesAreCutBeforeTheyBecomeATrailer) {
  const grpc::Status st = ToGrpc(absl::NotFoundError(std::string(10240, 'x')));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_LE(st.error_message().size(), kMaxGrpcMessageBytes + 64);
  EXPECT_NE(st.error_message().find("(message cut, 10240 bytes)"), std::string::npos);
  EXPECT_EQ(ToGrpc(absl::InvalidArgumentError("short")).error_message(), "short");
}

}  // namespace
}  // namespace logprob
