#include "client/bench_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "nlohmann/json.hpp"

namespace logprob::client {
namespace {

double TokensPerSecond(const BenchReport& r, const PhaseResult& p) {
  return RequestsPerSecond(p) * static_cast<double>(r.tokens_per_request);
}

// Request payload, MB (1e6 bytes) per second.
double MegabytesPerSecond(const BenchReport& r, const PhaseResult& p) {
  return RequestsPerSecond(p) * static_cast<double>(r.request_bytes) / 1e6;
}

std::string ShapeText(const BenchShape& s) {
  const std::string dims = s.packed_tokens > 0
                               ? absl::StrCat("[", s.packed_tokens, ", ", s.vocab, "] packed, ", s.batch, " sequences")
                               : absl::StrCat("[", s.batch, ", ", s.seq, ", ", s.vocab, "]");
  if (s.hidden > 0) {
    const std::string hdims =
        s.packed_tokens > 0 ? absl::StrCat("[", s.packed_tokens, ", ", s.hidden, "] packed, ", s.batch, " sequences")
                            : absl::StrCat("[", s.batch, ", ", s.seq, ", ", s.hidden, "]");
    return absl::StrCat("hidden_states ", DTypeName(s.dtype), " ", hdims, " (lm_head V = ", s.vocab, ")");
  }
  return absl::StrCat("logits ", DTypeName(s.dtype), " ", dims);
}

std::string OptionsText(const v1::ScoreOptions& o) {
  const std::string text = o.ShortDebugString();
  return text.empty() ? "defaults" : text;
}

std::string Bytes(int64_t n) {
  if (n >= 1000000) return absl::StrFormat("%.1f MB", n / 1e6);
  if (n >= 1000) return absl::StrFormat("%.1f kB", n / 1e3);
  return absl::StrCat(n, " B");
}

std::string PhaseRow(const BenchReport& r, const PhaseResult& p) {
  const LatencySummary& l = p.latency;
  return absl::StrFormat("%-12s %9d %7d %8.2f %9.2f %11.0f %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f\n", p.name, p.ok,
                         p.failed, p.seconds, RequestsPerSecond(p), TokensPerSecond(r, p), MegabytesPerSecond(r, p),
                         l.mean * 1e3, l.p50 * 1e3, l.p90 * 1e3, l.p99 * 1e3, l.max * 1e3);
}

std::string Percent(double part, double whole) {
  return whole > 0 ? absl::StrFormat("%.1f %%", 100 * part / whole) : "-";
}

nlohmann::json PhaseJson(const BenchReport& r, const PhaseResult& p) {
  const LatencySummary& l = p.latency;
  nlohmann::json failures = nlohmann::json::object();
  for (const auto& [code, n] : p.failures) failures[code] = n;
  return {{"seconds", p.seconds},
          {"requests_ok", p.ok},
          {"requests_failed", p.failed},
          {"failures", failures},
          {"first_error", p.first_error},
          {"requests_per_s", RequestsPerSecond(p)},
          {"tokens_per_s", TokensPerSecond(r, p)},
          {"request_mb_per_s", MegabytesPerSecond(r, p)},
          {"latency_s",
           {{"count", l.count},
            {"mean", l.mean},
            {"min", l.min},
            {"p50", l.p50},
            {"p90", l.p90},
            {"p99", l.p99},
            {"max", l.max}}}};
}

}  // namespace

double RequestsPerSecond(const PhaseResult& p) { return p.seconds > 0 ? static_cast<double>(p.ok) / p.seconds : 0; }

std::optional<double> ScoringOverEcho(const BenchReport& r) {
  const std::optional<PhaseResult>& echo = r.chunked ? r.echo_chunked : r.echo;
  if (!echo || RequestsPerSecond(*echo) <= 0) return std::nullopt;
  return RequestsPerSecond(r.scoring) / RequestsPerSecond(*echo);
}

std::string FormatBenchTable(const BenchReport& r) {
  std::string out = absl::StrCat("logprob-client bench: ", r.server, ", ", ShapeText(r.shape), ", options ",
                                 OptionsText(r.options), ", concurrency ", r.concurrency, "\n");
  absl::StrAppend(&out, "per request: ", Bytes(r.request_bytes), " sent, ", Bytes(r.reply_bytes), " received, ",
                  r.tokens_per_request, " tokens\n\n");
  absl::StrAppendFormat(&out, "%-12s %9s %7s %8s %9s %11s %9s %8s %8s %8s %8s %8s\n", "phase", "requests", "failed",
                        "seconds", "req/s", "tokens/s", "MB/s", "mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms");
  absl::StrAppend(&out, PhaseRow(r, r.scoring));
  if (r.echo) absl::StrAppend(&out, PhaseRow(r, *r.echo));
  if (r.echo_chunked) absl::StrAppend(&out, PhaseRow(r, *r.echo_chunked));
  if (const std::optional<double> ratio = ScoringOverEcho(r)) {
    absl::StrAppendFormat(&out,
                          "\nscoring / %s throughput: %.3f (same request and reply bytes, scoring %s; echo = gRPC "
                          "transfer alone, in-process server on loopback)\n",
                          r.chunked ? "echo-chunked" : "echo", *ratio,
                          r.chunked ? "in pieces (ScoreChunked)" : "in one message (Score)");
  }
  for (const PhaseResult* p : {&r.scoring, r.echo ? &*r.echo : nullptr, r.echo_chunked ? &*r.echo_chunked : nullptr}) {
    if (p == nullptr || p->failed == 0) continue;
    std::vector<std::string> codes;
    for (const auto& [code, n] : p->failures) codes.push_back(absl::StrCat(code, " x", n));
    absl::StrAppend(&out, p->name, " failures: ", absl::StrJoin(codes, ", "), "; first: ", p->first_error, "\n");
  }
  if (r.split) {
    const ServerSplit& s = *r.split;
    const double rest = s.request_mean - s.queue_mean - s.worker_call_mean;
    const double dispatch = s.worker_call_mean - s.compute_mean;
    absl::StrAppendFormat(&out,
                          "\nserver time per %s request (means over %.0f requests in %.0f worker batches, "
                          "from /metrics): %.1f ms\n"
                          "  batching queue:                              %8.1f ms (%s)\n"
                          "  validation, planning, reply assembly:        %8.1f ms (%s)\n"
                          "  dispatch to workers and gathering:           %8.1f ms (%s)\n"
                          "  worker compute (slowest worker):             %8.1f ms (%s)\n",
                          r.chunked ? "ScoreChunked" : "Score", s.requests, s.batches, s.request_mean * 1e3,
                          s.queue_mean * 1e3, Percent(s.queue_mean, s.request_mean), rest * 1e3,
                          Percent(rest, s.request_mean), dispatch * 1e3, Percent(dispatch, s.request_mean),
                          s.compute_mean * 1e3, Percent(s.compute_mean, s.request_mean));
    if (r.scoring.latency.count > 0) {
      absl::StrAppendFormat(&out,
                            "  client latency mean %.1f ms: %.1f ms outside the server's handler "
                            "(serialization, transfer, parsing)\n",
                            r.scoring.latency.mean * 1e3, (r.scoring.latency.mean - s.request_mean) * 1e3);
    }
  }
  return out;
}

std::string FormatBenchJson(const BenchReport& r) {
  nlohmann::json j = {
      {"server", r.server},
      {"shape",
       {{"batch", r.shape.batch},
        {"seq", r.shape.packed_tokens > 0 ? 0 : r.shape.seq},
        {"packed_tokens", r.shape.packed_tokens},
        {"vocab", r.shape.vocab},
        {"hidden_size", r.shape.hidden},
        {"dtype", DTypeName(r.shape.dtype)}}},
      {"options", OptionsText(r.options)},
      {"concurrency", r.concurrency},
      {"request_bytes", r.request_bytes},
      {"reply_bytes", r.reply_bytes},
      {"tokens_per_request", r.tokens_per_request},
      {"scoring", PhaseJson(r, r.scoring)},
      {"transport", r.chunked ? "ScoreChunked" : "Score"},
      {"echo", r.echo ? PhaseJson(r, *r.echo) : nlohmann::json()},
      {"echo_chunked", r.echo_chunked ? PhaseJson(r, *r.echo_chunked) : nlohmann::json()},
      {"scoring_over_echo", nlohmann::json()},
      {"server_split", nlohmann::json()},
  };
  if (const std::optional<double> ratio = ScoringOverEcho(r)) j["scoring_over_echo"] = *ratio;
  if (r.split) {
    j["server_split"] = {{"requests", r.split->requests},
                         {"request_mean_s", r.split->request_mean},
                         {"queue_mean_s", r.split->queue_mean},
                         {"batches", r.split->batches},
                         {"worker_call_mean_s", r.split->worker_call_mean},
                         {"compute_mean_s", r.split->compute_mean}};
  }
  return j.dump() + "\n";
}

}  // namespace logprob::client
