// libFuzzer target: the internal plane's messages (docs/security.md "The
// internal plane"). Each input is a selector byte, then the bytes of one
// internal message: a JoinRequest, ReadyRequest, StoreSetRequest,
// StoreGetRequest, LmHeadRowsRequest or WorkItem (parsed as far as
// protobuf takes them).
//
// Invariants (a violation traps):
//  - a ControlService with a pool secret answers every method of an
//    unauthenticated call UNAUTHENTICATED before it reads the message or
//    touches the stream (Join and ReadLmHeadRows get no writer at all);
//  - an open ControlService takes any Ready / StoreSet / StoreGet without
//    crashing or hanging; a stored key is of the current generation and
//    within the store's limits;
//  - PayloadRegions opens only the front-end's own payload regions: never
//    the client's region this process made (its marker never comes back),
//    whatever name, offset and size the item carries; any range it returns
//    lies inside the region.
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "common/internal_auth.h"
#include "common/pool_secret.h"
#include "common/shared_memory.h"
#include "google/protobuf/stubs/logging.h"
#include "logprob/internal/v1/worker.pb.h"
#include "server/pool/control_service.h"
#include "worker/scoring/payload_regions.h"

namespace {

#define CHECK(cond)                                                                                     \
  do {                                                                                                  \
    if (!(cond)) {                                                                                      \
      std::fprintf(stderr, "fuzz_internal_plane: invariant violated: %s (line %d)\n", #cond, __LINE__); \
      __builtin_trap();                                                                                 \
    }                                                                                                   \
  } while (0)

namespace iv1 = logprob::internal::v1;
constexpr char kMarker[] = "ANOTHER-CLIENT'S-HIDDEN-STATES";

struct State {
  logprob::ControlService secured{
      2, {}, {}, {}, logprob::kWorkerProtocolVersion, logprob::InternalAuth(logprob::PoolSecret::Generate())};
  logprob::ControlService open{2};
  logprob::PayloadRegions regions{4, nullptr, logprob::OwnRegionPrefix()};
  std::unique_ptr<logprob::SharedRegion> victim, own;
};

State& Get() {
  static State* s = [] {
    google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
    auto* st = new State;
    st->victim = *logprob::SharedRegion::Create(4096, "/logprob-client-" + std::to_string(getpid()) + "-victim");
    std::memcpy(st->victim->data(), kMarker, sizeof kMarker);
    st->own = *logprob::SharedRegion::Create(4096);
    std::memset(st->own->data(), 0, 4096);
    return st;
  }();
  return *s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  State& st = Get();
  FuzzedDataProvider in(data, size);
  const int which = in.ConsumeIntegralInRange<int>(0, 6);
  const std::string bytes = in.ConsumeRemainingBytesAsString();
  grpc::ServerContext ctx;  // no metadata: an outsider's call
  switch (which) {
    case 0: {
      iv1::JoinRequest req;
      (void)req.ParseFromString(bytes);
      CHECK(st.secured.Join(&ctx, &req, nullptr).error_code() == grpc::StatusCode::UNAUTHENTICATED);
      break;
    }
    case 1: {
      iv1::ReadyRequest req;
      (void)req.ParseFromString(bytes);
      iv1::ReadyReply reply;
      CHECK(st.secured.Ready(&ctx, &req, &reply).error_code() == grpc::StatusCode::UNAUTHENTICATED);
      (void)st.open.Ready(&ctx, &req, &reply);
      break;
    }
    case 2: {
      iv1::StoreSetRequest req;
      (void)req.ParseFromString(bytes);
      iv1::StoreSetReply reply;
      CHECK(st.secured.StoreSet(&ctx, &req, &reply).error_code() == grpc::StatusCode::UNAUTHENTICATED);
      if (st.open.StoreSet(&ctx, &req, &reply).ok()) {
        CHECK(req.key().rfind("gen0/", 0) == 0);
        CHECK(req.key().size() <= logprob::ControlService::kMaxStoreKeyBytes);
        CHECK(req.value().size() <= logprob::ControlService::kMaxStoreValueBytes);
      }
      break;
    }
    case 3: {
      iv1::StoreGetRequest req;
      (void)req.ParseFromString(bytes);
      iv1::StoreGetReply reply;
      CHECK(st.secured.StoreGet(&ctx, &req, &reply).error_code() == grpc::StatusCode::UNAUTHENTICATED);
      req.set_timeout_ms(0);  // never wait for keys nobody sets
      const grpc::Status s = st.open.StoreGet(&ctx, &req, &reply);
      if (s.ok()) CHECK(reply.values_size() == req.keys_size());
      break;
    }
    case 4: {
      iv1::LmHeadRowsRequest req;
      (void)req.ParseFromString(bytes);
      CHECK(st.secured.ReadLmHeadRows(&ctx, &req, nullptr).error_code() == grpc::StatusCode::UNAUTHENTICATED);
      break;
    }
    default: {
      iv1::WorkItem item;
      (void)item.ParseFromString(bytes);
      // Half the inputs aim at the two real regions by name.
      if (which == 6 && item.has_shared_memory())
        item.mutable_shared_memory()->set_name(bytes.size() % 2 ? st.victim->name() : st.own->name());
      std::shared_ptr<logprob::SharedRegion> hold;
      auto payload = st.regions.Payload(item, &hold);
      if (payload.ok() && item.has_shared_memory()) {
        CHECK(hold != nullptr);
        CHECK(hold->name() != st.victim->name());
        CHECK(logprob::IsPoolRegionName(item.shared_memory().name(), logprob::OwnRegionPrefix()));
        CHECK(payload->data() >= hold->data() && payload->data() + payload->size() <= hold->data() + hold->size());
        CHECK(payload->find(kMarker) == std::string_view::npos);
      }
      break;
    }
  }
  return 0;
}
