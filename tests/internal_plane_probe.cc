// internal_plane_probe: calls every method of every service declared in
// proto/logprob/internal/v1/worker.proto on each HOST:PORT given, as a
// caller outside the pool would (no pool secret, or --secret=VALUE, a
// wrong one), and prints one line per call: "PORT SERVICE.METHOD CODE".
// Most requests are the default message; a few are the forged messages of
// known attacks: Ready for the next generation's rank 0, a lone
// VOCAB_PARALLEL Run, a Run reading the shared-memory object --region
// names, a LoadLmHead of /etc/passwd, a ReadLmHeadRows of a huge row, a
// StoreSet of 1 MiB. A port that does not answer a first gRPC call within
// 3 s (not a gRPC server: Gloo's sockets) prints "PORT - not-grpc CODE"
// and gets no more calls. Used by tests/internal_plane_test.cc, also
// under another uid (setpriv).
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/internal_auth.h"
#include "common/metadata_channel.h"
#include "google/protobuf/descriptor.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "tests/generic_call.h"

namespace {

using google::protobuf::Message;
namespace iv1 = logprob::internal::v1;

/// The request `method` gets: a forged message for the known attacks, else
/// the default instance of its input type.
std::string Request(const std::string& method, const std::string& region) {
  if (method == "Control.Ready") {
    iv1::ReadyRequest r;
    r.set_rank(0);
    r.set_store_prefix("gen1/");
    r.set_worker_address("127.0.0.1:1");
    return r.SerializeAsString();
  }
  if (method == "Control.StoreSet") {
    iv1::StoreSetRequest r;
    r.set_key("gen1/attacker");
    r.set_value(std::string(1 << 20, 'x'));
    return r.SerializeAsString();
  }
  if (method == "Control.ReadLmHeadRows") {
    iv1::LmHeadRowsRequest r;
    r.mutable_source()->set_file("/etc/passwd");
    r.mutable_source()->set_dtype(logprob::v1::BF16);
    r.mutable_source()->set_vocab_size(1);
    r.mutable_source()->set_hidden_size(int64_t{1} << 28);
    r.set_row_end(1);
    return r.SerializeAsString();
  }
  if (method == "Worker.Run" || method == "Worker.Run(region)") {
    iv1::WorkItem item;
    item.set_layout(iv1::VOCAB_PARALLEL);
    item.set_dtype(logprob::v1::F32);
    item.set_num_rows(1);
    item.set_vocab_size(8);
    item.set_vocab_begin(0);
    item.set_vocab_end(4);
    item.add_targets(1);
    if (method == "Worker.Run(region)") {
      item.mutable_shared_memory()->set_name(region);
      item.mutable_shared_memory()->set_byte_size(16);
    } else {
      item.set_data(std::string(16, '\0'));
    }
    return item.SerializeAsString();
  }
  if (method == "Worker.LoadLmHead") {
    iv1::LmHeadLoad r;
    r.mutable_head()->set_name("attacker");
    r.mutable_source()->set_file("/etc/passwd");
    r.mutable_source()->set_dtype(logprob::v1::BF16);
    r.mutable_source()->set_vocab_size(1);
    r.mutable_source()->set_hidden_size(8);
    return r.SerializeAsString();
  }
  return "";  // the default instance of any message serializes to no bytes
}

}  // namespace

int main(int argc, char** argv) {
  std::string secret, region = "/logprob-client-0-probe";
  std::vector<std::string> targets;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--secret=", 9) == 0) {
      secret = argv[i] + 9;
    } else if (std::strncmp(argv[i], "--region=", 9) == 0) {
      region = argv[i] + 9;
    } else {
      targets.emplace_back(argv[i]);
    }
  }
  const google::protobuf::FileDescriptor* file = iv1::WorkItem::descriptor()->file();
  for (const std::string& target : targets) {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    auto channel = secret.empty() ? grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args)
                                  : logprob::ChannelWithMetadata(target, grpc::InsecureChannelCredentials(), args,
                                                                 logprob::kPoolSecretMetadataKey, secret);
    const std::string port = target.substr(target.rfind(':') + 1);
    // Is it a gRPC server at all? (Gloo's sockets never answer HTTP/2.)
    const grpc::Status first =
        logprob::testing::GenericUnaryCall(channel, "/logprob.internal.v1.Worker/Info", "", std::chrono::seconds(3));
    if (first.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        first.error_code() == grpc::StatusCode::UNAVAILABLE) {
      std::printf("%s - not-grpc %d\n", port.c_str(), static_cast<int>(first.error_code()));
      std::fflush(stdout);
      continue;
    }
    for (int s = 0; s < file->service_count(); ++s) {
      const google::protobuf::ServiceDescriptor* service = file->service(s);
      for (int m = 0; m < service->method_count(); ++m) {
        const std::string path = "/" + service->full_name() + "/" + service->method(m)->name();
        const std::string name = service->name() + "." + service->method(m)->name();
        std::vector<std::string> variants = {name};
        if (name == "Worker.Run") variants.push_back("Worker.Run(region)");
        for (const std::string& variant : variants) {
          const grpc::Status st =
              logprob::testing::GenericUnaryCall(channel, path, Request(variant, region), std::chrono::seconds(10));
          std::printf("%s %s %d\n", port.c_str(), variant.c_str(), static_cast<int>(st.error_code()));
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
