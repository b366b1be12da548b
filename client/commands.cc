#include "client/commands.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <iterator>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/health_check.h"
#include "client/summary.h"
#include "common/channel.h"
#include "common/grpc_status.h"
#include "common/request_bytes.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"

namespace logprob::client {
namespace {

// `status` with "path: " in front of its message unless it names `path`.
absl::Status WithPath(const std::string& path, const absl::Status& status) {
  if (absl::StrContains(status.message(), path)) return status;
  return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
}

// An id for a request of this process.
std::string MakeRequestId() {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  return absl::StrCat("cli-", getpid(), "-", ms);
}

}  // namespace

void PrintError(const absl::Status& status) { std::cerr << "error: " << status.ToString() << std::endl; }

void AnnounceRequestBytes(grpc::ClientContext* context, const v1::ScoreRequest& request) {
  context->AddMetadata(kRequestBytesMetadataKey, std::to_string(request.ByteSizeLong()));
}

void SetTimeout(grpc::ClientContext* context, double seconds) {
  if (seconds <= 0) return;
  context->set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(seconds)));
}

std::shared_ptr<grpc::Channel> OpenChannel(const std::string& server, const ChannelOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(server, options);
  if (!channel.ok()) {
    PrintError(channel.status());
    return nullptr;
  }
  if ((!options.auth_token_file.empty() || !options.update_token_file.empty()) && !UsesTls(options)) {
    std::cerr << "warning: " << (options.update_token_file.empty() ? "--auth-token-file" : "--update-token-file")
              << " without TLS (--tls-ca): the token is sent in plaintext" << std::endl;
  }
  return *std::move(channel);
}

absl::StatusOr<v1::ServerInfo> FetchServerInfo(v1::LogprobService::StubInterface& stub, double timeout_seconds) {
  grpc::ClientContext context;
  SetTimeout(&context, timeout_seconds > 0 ? timeout_seconds : 60.0);
  v1::ServerInfo info;
  const grpc::Status s = stub.GetServerInfo(&context, v1::ServerInfoRequest(), &info);
  if (!s.ok()) return FromGrpc(s);
  return info;
}

int RunHealth(const HealthArgs& args) {
  const auto wait =
      std::chrono::milliseconds(static_cast<int64_t>(std::llround(std::max(0.0, args.wait_seconds) * 1000)));
  std::shared_ptr<grpc::Channel> channel = OpenChannel(args.server, args.channel);
  if (!channel) return kExitBadInput;
  absl::Status s = WaitForServing(channel, wait);
  if (!s.ok()) {
    std::cerr << "error: " << args.server << ": " << s.message() << std::endl;
    return kExitFailure;
  }
  std::cout << args.server << ": SERVING" << std::endl;
  return kExitOk;
}

absl::StatusOr<v1::ScoreResponse> ScoreInParts(v1::LogprobService::StubInterface& stub,
                                               const std::shared_ptr<grpc::Channel>& channel,
                                               const v1::ScoreRequest& request, const SplitLimits& limits,
                                               const ChunkOptions& chunking, double timeout_seconds,
                                               const std::function<void(int, int)>& progress, int* parts_sent,
                                               ShmInputs* shm) {
  LOGPROB_ASSIGN_OR_RETURN(std::vector<v1::ScoreRequest> parts, SplitScoreRequest(request, limits));
  const int n = static_cast<int>(parts.size());
  std::vector<v1::ScoreResponse> responses(n);
  for (int i = 0; i < n; ++i) {
    // All parts scored by one version: the one that scored the first part.
    if (i > 0 && parts[i].head_version().empty()) parts[i].set_head_version(responses[0].head_version());
    absl::Status s;
    if (shm == nullptr && channel && UseChunked(chunking, static_cast<int64_t>(parts[i].ByteSizeLong()))) {
      absl::StatusOr<v1::ScoreResponse> r = ScoreChunked(channel, parts[i], chunking.piece_bytes, timeout_seconds);
      s = r.status();
      if (r.ok()) responses[i] = *std::move(r);
    } else {
      grpc::ClientContext context;
      SetTimeout(&context, timeout_seconds);
      if (shm != nullptr) {
        LOGPROB_RETURN_IF_ERROR(shm->Place(&parts[i]));
        shm->Attach(&context);
      }
      AnnounceRequestBytes(&context, parts[i]);
      s = FromGrpc(stub.Score(&context, parts[i], &responses[i]));
    }
    if (!s.ok()) {
      if (n == 1) return s;
      return absl::Status(s.code(), absl::StrCat("part ", i + 1, "/", n, " (id ", parts[i].id(), "): ", s.message()));
    }
    // Free each part's tensors once it has been sent.
    parts[i] = v1::ScoreRequest();
    if (n > 1 && progress) progress(i + 1, n);
  }
  if (parts_sent != nullptr) *parts_sent = n;
  return JoinScoreResponses(std::move(responses), request.id());
}

int RunScore(const ScoreArgs& args) {
  // The file is mapped: a request sent in pieces views its bytes there.
  absl::StatusOr<MappedSafetensors> file = MappedSafetensors::Open(args.input);
  if (!file.ok()) {
    PrintError(WithPath(args.input, file.status()));
    return kExitBadInput;
  }
  absl::StatusOr<v1::ScoreRequest> request = BuildScoreRequest(
      std::move(file->file()), ToScoreOptions(args.flags), MakeRequestId(), args.rollout_logprobs, args.sampling_mask);
  if (request.ok()) request = SelectLmHead(*std::move(request), args.head, args.head_version);
  if (!request.ok()) {
    PrintError(WithPath(args.input, request.status()));
    return kExitBadInput;
  }

  std::shared_ptr<grpc::Channel> channel = OpenChannel(args.server, args.channel);
  if (!channel) return kExitBadInput;
  std::unique_ptr<v1::LogprobService::Stub> stub = v1::LogprobService::NewStub(channel);

  absl::StatusOr<v1::ServerInfo> info = FetchServerInfo(*stub, args.timeout_seconds);
  if (!info.ok()) {
    PrintError(info.status());
    return kExitFailure;
  }
  int64_t limit = args.max_request_bytes > 0 ? args.max_request_bytes : info->max_request_bytes();
  if (limit <= 0) limit = kDefaultMaxRequestBytes;
  SplitLimits limits;
  limits.max_bytes = std::max<int64_t>(1, static_cast<int64_t>(limit * kRequestFill));
  limits.max_tokens = info->max_tokens_per_request();

  std::unique_ptr<ShmInputs> shm;
  if (args.shared_memory) {
    if (!SameSharedMemoryHost(*info)) {
      PrintError(absl::FailedPreconditionError(
          info->shared_memory_inputs()
              ? "--shared-memory: the server does not share this host's /dev/shm (host_id differs)"
              : "--shared-memory: the server has shared-memory inputs off"));
      return kExitFailure;
    }
    shm = std::make_unique<ShmInputs>(*stub, args.timeout_seconds);
  }
  // The request's tensors without data, and their bytes in the mapping.
  int64_t request_bytes = static_cast<int64_t>(request->ByteSizeLong());
  std::vector<int> pieced;
  std::vector<std::string_view> data;
  // The file's name of each input (--rollout-logprobs renames its tensor).
  auto source_name = [&](const std::string& name) {
    return SourceTensorName(name, args.rollout_logprobs, args.sampling_mask);
  };
  for (int i = 0; i < request->inputs_size(); ++i) {
    const std::string_view bytes = file->data(source_name(request->inputs(i).name()));
    request_bytes += static_cast<int64_t>(bytes.size()) + 16;  // + the field's tag and length
    if (static_cast<int64_t>(bytes.size()) > kInlineBytes) {
      pieced.push_back(i);
      data.push_back(bytes);
    } else {
      request->mutable_inputs(i)->set_data(bytes.data(), bytes.size());
    }
  }
  const int64_t tokens = CountInputTokens(*request);
  const int64_t scored_tokens =
      CountScoredTokens(*request, [&](const std::string& name) { return file->data(source_name(name)); });
  const bool one_request = request_bytes <= limits.max_bytes && (limits.max_tokens <= 0 || tokens <= limits.max_tokens);

  const auto start = std::chrono::steady_clock::now();
  int parts = 1;
  absl::StatusOr<v1::ScoreResponse> response;
  if (!shm && one_request && UseChunked(args.chunking, request_bytes)) {
    response = ScoreChunkedViews(channel, *request, pieced, data, args.chunking.piece_bytes, args.timeout_seconds);
  } else {
    // One message, or split into parts, or through shared memory: the request holds its bytes.
    for (size_t k = 0; k < pieced.size(); ++k)
      request->mutable_inputs(pieced[k])->set_data(data[k].data(), data[k].size());
    response = ScoreInParts(
        *stub, channel, *request, limits, args.chunking, args.timeout_seconds,
        [](int i, int n) { std::cerr << "scored part " << i << "/" << n << std::endl; }, &parts, shm.get());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!response.ok()) {
    PrintError(response.status());
    return kExitFailure;
  }

  std::vector<v1::Tensor> outputs(std::make_move_iterator(response->mutable_outputs()->begin()),
                                  std::make_move_iterator(response->mutable_outputs()->end()));
  std::map<std::string, std::string> metadata;
  if (response->has_rollout_mismatch()) {
    const v1::RolloutMismatch& m = response->rollout_mismatch();
    metadata = {{"rollout_tokens", absl::StrCat(m.tokens())},
                {"rollout_mean_abs_log_ratio", absl::StrCat(m.mean_abs_log_ratio())},
                {"rollout_k1", absl::StrCat(m.k1())},
                {"rollout_k3", absl::StrCat(m.k3())},
                {"rollout_outside_band_fraction", absl::StrCat(m.outside_band_fraction())}};
  }
  if (absl::Status s = WriteSafetensors(args.output, outputs, metadata); !s.ok()) {
    PrintError(WithPath(args.output, s));
    return kExitFailure;
  }
  std::cout << SummarizeScore(outputs, scored_tokens, tokens, seconds, parts);
  if (!response->head().empty())
    std::cout << "lm_head " << response->head() << " version " << response->head_version() << std::endl;
  if (response->has_rollout_mismatch()) {
    const v1::RolloutMismatch& m = response->rollout_mismatch();
    std::cout << "rollout mismatch: " << m.tokens() << " tokens compared, mean |l| " << m.mean_abs_log_ratio()
              << ", k1 " << m.k1() << ", k3 " << m.k3() << ", outside band " << m.outside_band_fraction() << std::endl;
  }
  return kExitOk;
}

}  // namespace logprob::client
