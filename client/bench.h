// The `bench` command of logprob-client: a load generator that measures
// logprob-server's throughput and latency for a synthetic request shape,
// and the same load against an in-process echo server (gRPC transfer
// alone) so the service's overhead over transfer shows as a ratio.
#pragma once

#include <cstdint>
#include <string>

#include "client/bench_payload.h"
#include "client/chunked_call.h"
#include "client/request_builder.h"
#include "common/channel.h"

namespace logprob::client {

/// Arguments of `logprob-client bench` (flags in UsageText()).
struct BenchArgs {
  std::string server;            // --server HOST:PORT
  ChannelOptions channel;        // --tls-*, --auth-token-file
  BenchShape shape;              // --batch, --seq, --packed, --vocab, --dtype, --hidden-size
  ChunkOptions chunking;         // --chunk-above, --piece-bytes: scoring calls over the threshold use ScoreChunked
  ScoreFlags flags;              // --entropy, --topk, ... as for `score`
  int concurrency = 1;           // --concurrency: calls in flight (one thread each, one shared channel)
  double duration_seconds = 10;  // --duration: measured seconds per phase
  int64_t requests = 0;          // --requests N > 0: N measured calls per phase instead of --duration
  double warmup_seconds = 1;     // --warmup: seconds of unmeasured calls before each phase
  bool echo = true;              // --no-echo: skip the echo phase
  bool shared_memory = false;    // --shared-memory: scoring phase's tensors in a registered region
  std::string metrics_url;       // --metrics-url http://HOST:PORT/metrics: server-side split
  bool json = false;             // --json: JSON on stdout instead of the table
  double progress_seconds = 5;   // --progress: seconds between progress lines on stderr; 0 = none
  double timeout_seconds = 0;    // --timeout: deadline of each call; 0 = none
};

/// Runs the bench:
///  1. asks the server for its limits and lm_head (GetServerInfo; with
///     --hidden-size H the server must have an lm_head of that H, whose V
///     the targets use), builds the request (BuildBenchRequest) and sends
///     one probe call, whose reply is the echo's reply; the request goes
///     through ScoreChunked when `chunking` says so (UseChunked), else
///     Score;
///  2. scoring phase: `concurrency` threads call Score back to back on one
///     channel for `warmup_seconds` (not measured), then for
///     `duration_seconds` or `requests` calls (measured); with
///     `metrics_url`, /metrics is scraped around the measured part;
///  3. echo phases: the same against an EchoServer on 127.0.0.1 (plaintext,
///     the server's max_request_bytes) answering with the probe's reply,
///     so all phases move the same request and reply bytes: "echo" in one
///     Score message, "echo-chunked" through ScoreChunked in pieces of
///     `chunking.piece_bytes` (the transport floor of either way);
///  4. prints FormatBenchTable (or FormatBenchJson) to stdout; progress
///     lines go to stderr every `progress_seconds`.
/// Exit codes: kExitOk when every measured and probe call succeeded;
/// kExitBadInput when the request is over the server's max_request_bytes,
/// --hidden-size is given and the server has no lm_head or another H,
/// or a TLS/token file or --metrics-url cannot be used; kExitFailure when
/// the server cannot be reached, the probe fails, or any measured call
/// failed (the report is printed first, failures counted by code).
int RunBench(const BenchArgs& args);

}  // namespace logprob::client
