#include "server/transport/lm_head_peer_sync.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/lm_head_update_driver.h"
#include "common/log_line.h"
#include "common/replica_target.h"
#include "common/status_macros.h"
#include "common/untrusted_text.h"
#include "grpcpp/client_context.h"
#include "logprob/v1/logprob.grpc.pb.h"
#include "server/heads/lm_head_update_calls.h"

namespace logprob {
namespace {

/// "IP:PORT" of every address HOST resolves to (none when it does not).
std::vector<std::string> Lookup(const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::vector<std::string> out;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    LogLine() << "logprob-server: --lm-head-sync-from: " << host << " resolves to no address (" << gai_strerror(rc)
              << ")";
    return out;
  }
  for (const addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    const void* where = a->ai_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr);
    if (inet_ntop(a->ai_family, where, ip, sizeof(ip)) == nullptr) continue;
    out.push_back(a->ai_family == AF_INET6 ? absl::StrCat("[", ip, "]:", port) : absl::StrCat(ip, ":", port));
  }
  freeaddrinfo(res);
  return out;
}

/// A peer's current version of one head.
struct PeerHead {
  std::string peer;
  v1::LmHeadInfo info;
};

/// Pulls `want` (a peer's current version of a head) from `peer` into
/// `updates`; `pulled` false when this server held it already.
absl::Status Pull(const PeerSyncOptions& options, const std::string& peer, const v1::LmHeadInfo& want,
                  const LmHeads& heads, LmHeadUpdates& updates, bool* pulled) {
  *pulled = false;
  LOGPROB_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, options.channel(peer));
  auto stub = v1::LogprobService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options.pull_timeout);
  v1::ReadLmHeadRowsRequest req;
  req.set_head(want.name());
  req.set_version(want.version());
  auto reader = stub->ReadLmHeadRows(&ctx, req);
  bool finished = false;
  // The stream's status (once), after its last part or to explain an early end.
  auto finish = [&]() -> absl::Status {
    if (finished) return absl::OkStatus();
    finished = true;
    return FromGrpc(reader->Finish());
  };
  auto cancel = [&] {
    ctx.TryCancel();
    (void)finish();
  };
  v1::LmHeadRowsChunk part;
  if (!reader->Read(&part) || !part.has_version()) {
    absl::Status st = finish();
    return st.ok() ? absl::DataLossError("ReadLmHeadRows answered no LmHeadVersionRows first") : st;
  }
  const v1::LmHeadVersionRows header = part.version();
  const v1::LmHeadInfo& got = header.info();
  const int64_t V = got.vocab_size(), H = got.hidden_size();
  if (got.version() != want.version() || (!want.sha256().empty() && got.sha256() != want.sha256()) ||
      V != want.vocab_size() || H != want.hidden_size() || got.dtype() != want.dtype() || header.row_begin() != 0 ||
      header.row_end() != V || got.sha256().empty()) {
    cancel();
    return absl::DataLossError(absl::StrCat("peer ", peer, " answered version \"", Printable(got.version(), 128),
                                            "\" sha256 ", Printable(got.sha256(), 64), " rows [", header.row_begin(),
                                            ", ", header.row_end(), ") for version \"", want.version(), "\""));
  }
  if (auto taken = heads.Taken(want.name(), want.version())) {
    cancel();
    if (taken->get() == got.sha256()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("lm_head \"", want.name(), "\" version \"", want.version(),
                                                      "\": this server holds sha256 ", taken->get(),
                                                      " under that name, peer ", peer, " holds ", got.sha256()));
  }
  v1::BeginLmHeadUpdateRequest begin;
  begin.set_head(want.name());
  begin.set_version(want.version());
  begin.set_vocab_size(V);
  begin.set_hidden_size(H);
  begin.set_dtype(got.dtype());
  begin.set_sha256(got.sha256());
  begin.set_logit_scale(got.logit_scale());
  begin.set_final_logit_softcapping(got.final_logit_softcapping());
  if (got.has_bias()) *begin.mutable_bias() = header.bias();
  const int64_t total = V * H * static_cast<int64_t>(DTypeSize(got.dtype()));
  // One put of every row, through the update core's Put as a client's: the
  // pieces land in the staged file as they arrive. The stream is read once.
  LmHeadRowSource rows;
  rows.rereadable = false;
  rows.cancel = [&ctx] { ctx.TryCancel(); };  // from the time-out's thread: Read then fails
  rows.read = [&](int64_t, int64_t, char* dst, const std::function<void(int64_t)>& progressed) -> absl::Status {
    int64_t have = 0;
    while (have < total && reader->Read(&part)) {
      const v1::TensorPiece& p = part.piece();
      if (!part.has_piece() || p.tensor() != 0 || p.offset() != have ||
          static_cast<int64_t>(p.data().size()) > total - have)
        return absl::DataLossError(absl::StrCat("peer ", peer, ": piece at offset ", p.offset(), " of ",
                                                p.data().size(), " bytes after ", have, " of ", total));
      std::memcpy(dst + have, p.data().data(), p.data().size());
      have += static_cast<int64_t>(p.data().size());
      if (progressed) progressed(have);
    }
    if (have == total) return finish();
    absl::Status st = finish();
    return absl::DataLossError(
        absl::StrCat("peer ", peer, "'s ReadLmHeadRows ended after ", have, " of ", total, " bytes: ", st.ToString()));
  };
  LmHeadUpdateDriverOptions one_put;
  one_put.rows_per_put = V;
  one_put.attempts = 1;  // a peer that fails is left for the next one
  InProcessLmHeadUpdateCalls calls(updates);
  // Begin checks the sha256 at commit; a failure aborts the update.
  absl::StatusOr<LmHeadUpdateOutcome> outcome = DriveLmHeadUpdate(calls, begin, rows, one_put);
  if (!outcome.ok() || outcome->already_committed) {
    cancel();
    return outcome.status();
  }
  *pulled = true;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ResolvePeerTarget(const std::string& target) {
  LOGPROB_ASSIGN_OR_RETURN(ReplicaTarget parsed, ParseReplicaTarget(target, "--lm-head-sync-from"));
  if (parsed.kind == ReplicaTarget::Kind::kListed) return parsed.addresses;
  // "dns:" and plain HOST:PORT alike: every pod behind a name is a peer.
  std::vector<std::string> out;
  for (const auto& [host, port] : parsed.host_ports)
    for (const std::string& a : Lookup(host, port))
      if (std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
  return out;
}

namespace {

/// One round of SyncLmHeadsFromPeers: the peers asked once. `ours`: head
/// -> the version an earlier round pulled.
absl::StatusOr<std::vector<PeerSyncResult>> SyncRound(const PeerSyncOptions& options, const LmHeads& heads,
                                                      LmHeadUpdates& updates,
                                                      const std::map<std::string, std::string>& ours) {
  LOGPROB_ASSIGN_OR_RETURN(std::vector<std::string> peers, ResolvePeerTarget(options.target));
  std::map<std::string, std::vector<PeerHead>> by_head;  // head -> the peers' current versions
  int answered = 0;
  for (const std::string& peer : peers) {
    LOGPROB_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, options.channel(peer));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + options.info_timeout);
    v1::ServerInfo info;
    grpc::Status st = v1::LogprobService::NewStub(channel)->GetServerInfo(&ctx, v1::ServerInfoRequest(), &info);
    if (!st.ok()) {
      LogLine() << "logprob-server: --lm-head-sync-from: peer " << peer << " did not answer GetServerInfo ("
                << FromGrpc(st).ToString() << "); skipped";
      continue;
    }
    ++answered;
    for (const v1::LmHeadInfo& h : info.lm_heads())
      if (h.committed_unix_ms() > 0) by_head[h.name()].push_back({peer, h});
  }
  LogLine() << "logprob-server: --lm-head-sync-from " << options.target << ": " << peers.size() << " peer address(es), "
            << answered << " answered";
  std::vector<PeerSyncResult> results;
  for (const v1::LmHeadInfo& local : heads.List()) {
    if (local.frozen()) continue;
    // A client's update reached this server meanwhile: it is the newest.
    if (local.committed_unix_ms() > 0 && (!ours.count(local.name()) || ours.at(local.name()) != local.version()))
      continue;
    auto it = by_head.find(local.name());
    if (it == by_head.end()) continue;
    // The newest version: the latest commit; ties: the version most peers hold.
    std::map<std::string, int> holders;
    for (const PeerHead& p : it->second) ++holders[p.info.version()];
    std::vector<PeerHead> order = it->second;
    std::stable_sort(order.begin(), order.end(), [&holders](const PeerHead& a, const PeerHead& b) {
      if (a.info.committed_unix_ms() != b.info.committed_unix_ms())
        return a.info.committed_unix_ms() > b.info.committed_unix_ms();
      return holders[a.info.version()] > holders[b.info.version()];
    });
    const v1::LmHeadInfo newest = order.front().info;
    if (newest.vocab_size() != local.vocab_size() || newest.hidden_size() != local.hidden_size() ||
        newest.dtype() != local.dtype())
      return absl::FailedPreconditionError(absl::StrCat(
          "lm_head \"", local.name(), "\": peer ", order.front().peer, " holds it as [", newest.vocab_size(), ", ",
          newest.hidden_size(), "] ", DTypeName(newest.dtype()), ", this server as [", local.vocab_size(), ", ",
          local.hidden_size(), "] ", DTypeName(local.dtype()), " (start every replica with the same --lm-head)"));
    PeerSyncResult result{local.name(), newest.version(), "", false};
    absl::Status last = absl::OkStatus();
    bool done = false;
    for (const PeerHead& p : order) {
      if (p.info.version() != newest.version() || (p.info.sha256() != newest.sha256() && !newest.sha256().empty()))
        continue;
      last = Pull(options, p.peer, newest, heads, updates, &result.pulled);
      if (last.ok()) {
        if (result.pulled) result.peer = p.peer;
        done = true;
        break;
      }
      if (last.code() == absl::StatusCode::kFailedPrecondition) return last;  // the name is taken here
      LogLine() << "logprob-server: --lm-head-sync-from: lm_head " << local.name() << " version " << newest.version()
                << " from " << p.peer << " failed: " << last.ToString();
    }
    if (!done) return last;
    LogLine() << "logprob-server: --lm-head-sync-from: lm_head " << local.name() << " version " << newest.version()
              << (result.pulled ? " pulled from " + result.peer : std::string(" held already"));
    results.push_back(result);
  }
  return results;
}

}  // namespace

absl::StatusOr<std::vector<PeerSyncResult>> SyncLmHeadsFromPeers(const PeerSyncOptions& options, const LmHeads& heads,
                                                                 LmHeadUpdates& updates) {
  // Again while a round pulled something: an update the peers committed
  // meanwhile is caught too.
  std::map<std::string, std::string> ours;  // head -> the version pulled
  for (int round = 1;; ++round) {
    LOGPROB_ASSIGN_OR_RETURN(std::vector<PeerSyncResult> results, SyncRound(options, heads, updates, ours));
    for (const PeerSyncResult& r : results)
      if (r.pulled) ours[r.head] = r.version;
    const bool pulled = std::any_of(results.begin(), results.end(), [](const PeerSyncResult& r) { return r.pulled; });
    if (!pulled || round == kPeerSyncRounds) return results;
  }
}

}  // namespace logprob
