// The `health` and `score` commands of logprob-client (docs/SPEC.md
// "Command-line contract").
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "client/chunked_call.h"
#include "client/request_builder.h"
#include "client/request_splitter.h"
#include "client/shm_inputs.h"
#include "common/channel.h"
#include "grpcpp/client_context.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob::client {

/// Process exit codes of the commands.
inline constexpr int kExitOk = 0;
/// Server error, unreachable or unhealthy server, or failure to write.
inline constexpr int kExitFailure = 1;
/// Bad command line, or an input file that cannot be read or used.
inline constexpr int kExitBadInput = 2;

/// Request size limit used when the server reports max_request_bytes 0.
inline constexpr int64_t kDefaultMaxRequestBytes = 64ll << 20;
/// Fraction of the request size limit a (split) request may fill.
inline constexpr double kRequestFill = 0.9;

/// Prints "error: CODE: message" to stderr.
void PrintError(const absl::Status& status);

/// Sets a deadline `seconds` from now on `context`; nothing when <= 0.
void SetTimeout(grpc::ClientContext* context, double seconds);

/// Announces `request`'s serialized size on a unary Score call's `context`
/// (metadata logprob-request-bytes: common/request_bytes.h), so the server
/// admits it before reading its body instead of reserving its largest size.
void AnnounceRequestBytes(grpc::ClientContext* context, const v1::ScoreRequest& request);

/// The channel to `server` with `options` (MakeChannel), warning on stderr
/// when a bearer token would travel without TLS; null after printing the
/// error when a TLS or token file cannot be used.
std::shared_ptr<grpc::Channel> OpenChannel(const std::string& server, const ChannelOptions& options);

/// The server's GetServerInfo (limits, workers, lm_head), with deadline
/// `timeout_seconds` (60 s when <= 0). Errors: the call's status.
absl::StatusOr<v1::ServerInfo> FetchServerInfo(v1::LogprobService::StubInterface& stub, double timeout_seconds);

/// Arguments of `logprob-client health`.
struct HealthArgs {
  std::string server;       // HOST:PORT
  double wait_seconds = 0;  // keep trying this long; 0 = one try
  ChannelOptions channel;   // TLS and bearer token (--tls-*, --auth-token-file)
};

/// Runs `health`: exit kExitOk once grpc.health.v1 reports SERVING within
/// `wait_seconds`, else prints the reason to stderr and returns
/// kExitFailure (kExitBadInput when a TLS or token file of `channel` cannot
/// be used).
int RunHealth(const HealthArgs& args);

/// Arguments of `logprob-client score`.
struct ScoreArgs {
  std::string server;  // HOST:PORT
  std::string input;   // IN.safetensors
  std::string output;  // OUT.safetensors
  ScoreFlags flags;
  int64_t max_request_bytes = 0;  // > 0 overrides the server's limit
  double timeout_seconds = 0;     // deadline of each RPC; 0 = none
  ChannelOptions channel;         // TLS and bearer token (--tls-*, --auth-token-file)
  ChunkOptions chunking;          // --chunk-above, --piece-bytes
  bool shared_memory = false;     // --shared-memory: tensors through a registered region (client/shm_inputs.h)
  std::string head;               // --head: the lm_head for hidden_states (ScoreRequest.head); empty: "default"
  std::string head_version;       // --head-version: pin that version (ScoreRequest.head_version); empty: current
  std::string rollout_logprobs;   // --rollout-logprobs: IN's F32 tensor sent as rollout_logprobs; empty: none
  std::string sampling_mask;      // --sampling-mask: IN's NAME_offsets / NAME_ids sent as the sampling mask
};

/// Runs `score`: reads the input file, asks the server for its limits
/// (GetServerInfo), sends the request (split into parts when it would
/// exceed kRequestFill of max_request_bytes or max_tokens_per_request),
/// writes the joined outputs to `output` and prints a summary to stdout
/// (for hidden states also the lm_head and version that scored them; with
/// `rollout_logprobs` also the request's rollout mismatch, which goes into
/// OUT's metadata too as rollout_tokens, rollout_mean_abs_log_ratio,
/// rollout_k1, rollout_k3 and rollout_outside_band_fraction).
/// `head` / `head_version` go into the request (hidden states only:
/// kExitBadInput for a logits file); a request split into parts pins every
/// later part to the version that scored the first, so all rows are scored
/// by one version.
/// Errors go to stderr as "error: CODE: message"; returns kExitBadInput
/// for unreadable/unusable input (also TLS and token files),
/// kExitFailure for everything else (e.g. UNAUTHENTICATED).
int RunScore(const ScoreArgs& args);

/// Sends `request` as the parts SplitScoreRequest makes under `limits`,
/// one call after another (each with deadline `timeout_seconds` when > 0):
/// with `shm`, each part's tensors go through its region (ShmInputs::Place)
/// and the part is one unary Score; otherwise a part over
/// `chunking.above_bytes` goes through ScoreChunked on `channel` (when
/// `channel` is null, always Score), others through a unary Score. Every
/// part carries the request's head; when the request pins no head_version,
/// the parts after the first pin the version the first part's answer names.
/// Joins the responses into the response of `request` (same id, head and
/// head_version of the first part's answer). `progress`,
/// when set, is called with (i, n) after part i of n > 1 has been scored.
/// Errors: the first failing call's status (gRPC code and message), or a
/// splitting/joining error.
absl::StatusOr<v1::ScoreResponse> ScoreInParts(v1::LogprobService::StubInterface& stub,
                                               const std::shared_ptr<grpc::Channel>& channel,
                                               const v1::ScoreRequest& request, const SplitLimits& limits,
                                               const ChunkOptions& chunking, double timeout_seconds,
                                               const std::function<void(int, int)>& progress, int* parts_sent = nullptr,
                                               ShmInputs* shm = nullptr);

}  // namespace logprob::client
