// Results of `logprob-client bench` and their two renderings: a table for
// people (stdout) and JSON (--json).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "client/bench_payload.h"
#include "client/latency_stats.h"
#include "logprob/v1/logprob.pb.h"

namespace logprob::client {

/// One measured phase: calls to logprob-server ("scoring") or to the
/// in-process echo server ("echo"), after the warm-up.
struct PhaseResult {
  std::string name;
  double seconds = 0;                       // wall time from the first call to the last answer
  int64_t ok = 0;                           // calls answered OK
  int64_t failed = 0;                       // calls that failed
  std::map<std::string, int64_t> failures;  // failed calls by status code name
  std::string first_error;                  // "CODE: message" of the first failure
  LatencySummary latency;                   // client-side latency of the OK calls, seconds
};

/// OK calls per second of `phase` (0 when it took no time).
double RequestsPerSecond(const PhaseResult& phase);

/// Means of the server's own timings over the scoring phase, from the
/// difference of two /metrics scrapes (--metrics-url): histogram sums over
/// counts of logprob_request_duration_seconds{method="Score"} (receipt of
/// the parsed request to its answer), logprob_worker_call_duration_seconds
/// (dispatch to the workers and gathering) and
/// logprob_compute_duration_seconds (the slowest worker's compute).
struct ServerSplit {
  double requests = 0;          // Score requests the server finished meanwhile
  double request_mean = 0;      // seconds per request
  double queue_mean = 0;        // seconds per request waiting in the batching queue
  double batches = 0;           // worker batches meanwhile (several requests may share one)
  double worker_call_mean = 0;  // seconds per worker batch
  double compute_mean = 0;      // seconds per worker batch (slowest worker)
};

/// Everything `logprob-client bench` reports.
struct BenchReport {
  std::string server;
  BenchShape shape;
  v1::ScoreOptions options;
  int concurrency = 1;
  int64_t request_bytes = 0;       // serialized ScoreRequest
  int64_t reply_bytes = 0;         // serialized ScoreResponse (the echo sends the same)
  int64_t tokens_per_request = 0;  // B * S or T
  bool chunked = false;            // the scoring phase used ScoreChunked (pieces), not Score
  PhaseResult scoring;
  std::optional<PhaseResult> echo;          // one Score message; absent with --no-echo
  std::optional<PhaseResult> echo_chunked;  // ScoreChunked in pieces; absent with --no-echo
  std::optional<ServerSplit> split;         // present with --metrics-url
};

/// Scoring throughput over echo throughput of the same transport
/// (echo_chunked when `chunked`, else echo; requests/s over requests/s,
/// the bytes per call are the same); absent without that echo phase or
/// when it completed no call.
std::optional<double> ScoringOverEcho(const BenchReport& report);

/// The human-readable report: a header (server, shape, sizes), one table
/// row per phase (requests, failures, seconds, requests/s, tokens/s,
/// request MB/s, latency mean/p50/p90/p99/max in ms), the scoring / echo
/// ratio and, with a split, the server's time per request broken down.
/// Lines end with '\n'.
std::string FormatBenchTable(const BenchReport& report);

/// The same as one JSON object on one line (keys in bench_report.cc;
/// seconds and bytes in base units, MB = 1e6 bytes), ending with '\n'.
std::string FormatBenchJson(const BenchReport& report);

}  // namespace logprob::client
