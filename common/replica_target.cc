#include "common/replica_target.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/untrusted_text.h"

namespace logprob {
namespace {

constexpr char kIpv4[] = "ipv4:";
constexpr char kIpv6[] = "ipv6:";
constexpr char kDnsAuthority[] = "dns:///";
constexpr char kDns[] = "dns:";

/// Host and port of "HOST:PORT" / "[IPV6]:PORT"; false when it is neither.
bool SplitAddress(const std::string& a, std::string* host, std::string* port) {
  size_t colon;
  if (absl::StartsWith(a, "[")) {
    const size_t close = a.find("]:");
    if (close == std::string::npos) return false;
    *host = a.substr(1, close - 1);
    colon = close + 1;
  } else {
    colon = a.rfind(':');
    if (colon == std::string::npos) return false;
    *host = a.substr(0, colon);
  }
  *port = a.substr(colon + 1);
  // A host is a name or an address: no scheme, path or blank; an IPv6 address only in brackets.
  const bool bracketed = absl::StartsWith(a, "[");
  for (const char c : *host)
    if (c == '/' || c == '[' || c == ']' || absl::ascii_isspace(static_cast<unsigned char>(c)) ||
        (c == ':' && !bracketed))
      return false;
  int number = 0;
  const bool digits = !port->empty() && std::all_of(port->begin(), port->end(), absl::ascii_isdigit);
  return !host->empty() && digits && absl::SimpleAtoi(*port, &number) && number >= 1 && number <= 65535;
}

}  // namespace

absl::StatusOr<ReplicaTarget> ParseReplicaTarget(const std::string& target, const std::string& flag) {
  std::string t(absl::StripAsciiWhitespace(target));
  ReplicaTarget out;
  if (absl::StartsWith(t, kIpv4) || absl::StartsWith(t, kIpv6)) {
    out.kind = ReplicaTarget::Kind::kListed;
    t = t.substr(5);
  } else if (absl::StartsWith(t, kDnsAuthority)) {
    out.kind = ReplicaTarget::Kind::kDns;
    t = t.substr(7);
  } else if (absl::StartsWith(t, kDns)) {
    out.kind = ReplicaTarget::Kind::kDns;
    t = t.substr(4);
  }
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " \"", Printable(target, 256), "\": ", why,
                     ": give HOST:PORT, several separated by commas, dns:///HOST:PORT or ipv4:IP:PORT,IP:PORT"));
  };
  for (absl::string_view piece : absl::StrSplit(t, ',')) {
    const std::string a(absl::StripAsciiWhitespace(piece));
    if (a.empty()) continue;
    std::string host, port;
    if (!SplitAddress(a, &host, &port)) return bad(absl::StrCat("\"", Printable(a, 256), "\" is not HOST:PORT"));
    if (std::find(out.addresses.begin(), out.addresses.end(), a) != out.addresses.end()) continue;
    out.addresses.push_back(a);
    out.host_ports.emplace_back(host, port);
  }
  if (out.addresses.empty()) return bad("no address");
  return out;
}

}  // namespace logprob
