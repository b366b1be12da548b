// ParseRequest (common/parsed_requests.h): large messages, whose bytes
// fields of 1 MiB or more are read into strings of their exact size,
// parse to the same message as protobuf's parser, over any slicing of the
// received bytes; malformed bytes are INVALID_ARGUMENT naming the method.
#include "common/parsed_requests.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "logprob/v1/logprob.pb.h"

namespace logprob {
namespace {

/// `bytes` as a received message cut into slices of `slice` bytes.
RawMessage Received(const std::string& bytes, size_t slice) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice)
    slices.emplace_back(bytes.data() + at, std::min(slice, bytes.size() - at));
  RawMessage raw;
  raw.buffer = grpc::ByteBuffer(slices.data(), slices.size());
  return raw;
}

v1::ScoreRequest LargeRequest() {
  std::mt19937 rng(3);
  v1::ScoreRequest req;
  req.set_id("large");
  req.set_head("policy");
  req.mutable_options()->set_entropy(true);
  req.mutable_options()->set_topk(5);
  for (const auto& [name, bytes] : std::vector<std::pair<std::string, size_t>>{
           {"hidden_states", (size_t{3} << 20) + 7}, {"input_ids", 4096}, {"gather_indices", size_t{1} << 20}}) {
    v1::Tensor* t = req.add_inputs();
    t->set_name(name);
    t->set_dtype(v1::BF16);
    t->add_shape(static_cast<int64_t>(bytes));
    std::string data(bytes, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    t->set_data(data);
  }
  return req;
}

TEST(ParseRequest, LargeBytesFieldsParseAsProtobufDoesOverAnySlicing) {
  const v1::ScoreRequest want = LargeRequest();
  const std::string bytes = want.SerializeAsString();
  for (const size_t slice : {size_t{1}, size_t{7}, size_t{4096}, size_t{1} << 20, bytes.size()}) {
    if (slice == 1 && bytes.size() > (size_t{1} << 16)) continue;  // too many slices to be quick
    SCOPED_TRACE(slice);
    RawMessage raw = Received(bytes, slice);
    v1::ScoreRequest got;
    ASSERT_TRUE(ParseRequest(&raw, &got, "Score", "the request").ok());
    EXPECT_EQ(got.SerializeAsString(), bytes);
    EXPECT_EQ(got.inputs(0).data().capacity(), want.inputs(0).data().size()) << "not read at its exact size";
  }
}

TEST(ParseRequest, MalformedOrTruncatedBytesAreInvalidArgumentNamingTheMethod) {
  const std::string bytes = LargeRequest().SerializeAsString();
  for (const std::string& bad : {bytes.substr(0, bytes.size() / 2), std::string("\x0a\xff\xff\xff", 4)}) {
    RawMessage raw = Received(bad, 4096);
    v1::ScoreRequest got;
    const grpc::Status st = ParseRequest(&raw, &got, "Score", "message 3");
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message(),
              "Score: message 3 is not a valid logprob.v1.ScoreRequest message (protobuf parse failed)");
  }
}

}  // namespace
}  // namespace logprob
