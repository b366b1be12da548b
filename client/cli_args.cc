#include "client/cli_args.h"

#include <cmath>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/channel.h"

namespace logprob::client {
namespace {

absl::Status BadValue(const std::string& flag, const std::string& value, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", value, "' is not ", what));
}

absl::Status ParseInt32(const std::string& flag, const std::string& v, int32_t* out) {
  if (!absl::SimpleAtoi(v, out)) return BadValue(flag, v, "an integer");
  return absl::OkStatus();
}

absl::Status ParseInt64(const std::string& flag, const std::string& v, int64_t* out) {
  if (!absl::SimpleAtoi(v, out)) return BadValue(flag, v, "an integer");
  return absl::OkStatus();
}

absl::Status ParseFloat(const std::string& flag, const std::string& v, float* out) {
  if (!absl::SimpleAtof(v, out) || std::isnan(*out)) return BadValue(flag, v, "a number");
  return absl::OkStatus();
}

absl::Status ParseSeconds(const std::string& flag, const std::string& v, double* out) {
  if (!absl::SimpleAtod(v, out) || !std::isfinite(*out) || *out < 0) {
    return BadValue(flag, v, "a number of seconds >= 0");
  }
  return absl::OkStatus();
}

absl::Status ParsePositive(const std::string& flag, const std::string& v, int64_t* out) {
  if (!absl::SimpleAtoi(v, out) || *out <= 0) return BadValue(flag, v, "an integer > 0");
  return absl::OkStatus();
}

absl::Status ParseBool(const std::string& flag, const std::string& v, bool* out) {
  if (v == "true" || v == "1") {
    *out = true;
  } else if (v == "false" || v == "0") {
    *out = false;
  } else {
    return BadValue(flag, v, "true or false");
  }
  return absl::OkStatus();
}

// Applies a "--flag value" shared by all commands (TLS, bearer token);
// false if `flag` is not one of them.
bool ApplyChannelFlag(const std::string& flag, const std::string& v, ChannelOptions* c) {
  if (flag == "tls-ca") {
    c->tls_ca = v;
  } else if (flag == "tls-cert") {
    c->tls_cert = v;
  } else if (flag == "tls-key") {
    c->tls_key = v;
  } else if (flag == "tls-server-name") {
    c->tls_server_name = v;
  } else if (flag == "auth-token-file") {
    c->auth_token_file = v;
  } else {
    return false;
  }
  return true;
}

// Applies one "--flag value" of `health`.
absl::Status ApplyHealthFlag(const std::string& flag, const std::string& v, HealthArgs* a) {
  if (ApplyChannelFlag(flag, v, &a->channel)) return absl::OkStatus();
  if (flag == "server") {
    a->server = v;
    return absl::OkStatus();
  }
  if (flag == "wait") return ParseSeconds(flag, v, &a->wait_seconds);
  return absl::InvalidArgumentError(absl::StrCat("health: unknown flag --", flag));
}

// Applies one "--flag value" of `heads` and `update-lm-head`.
absl::Status ApplyLmHeadFlag(const std::string& flag, const std::string& v, LmHeadArgs* a) {
  if (ApplyChannelFlag(flag, v, &a->channel)) return absl::OkStatus();
  if (flag == "server") {
    a->server = v;
  } else if (flag == "head") {
    a->head = v;
  } else if (flag == "version") {
    a->version = v;
  } else if (flag == "input") {
    a->input = v;
  } else if (flag == "tensor") {
    a->tensor = v;
  } else if (flag == "sha256") {
    a->sha256 = v;
  } else if (flag == "rows-per-call") {
    return ParsePositive(flag, v, &a->rows_per_call);
  } else if (flag == "update-token-file") {
    a->channel.update_token_file = v;
  } else if (flag == "timeout") {
    return ParseSeconds(flag, v, &a->timeout_seconds);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag --", flag));
  }
  return absl::OkStatus();
}

// Applies one scoring-option flag (--alignment, --entropy,
// --log-sum-sq-probs, --mean-logits, --is-top1, --topk, --temperature,
// --sampling-top-k, --sampling-top-p, --ignore-index) of
// `score` and `bench`; nullopt if `flag` is not one of them.
std::optional<absl::Status> ApplyOptionFlag(const std::string& flag, const std::string& v, ScoreFlags* f) {
  if (flag == "alignment") {
    absl::StatusOr<v1::Alignment> alignment = ParseAlignment(v);
    if (!alignment.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--alignment: ", alignment.status().message()));
    }
    f->alignment = *alignment;
  } else if (flag == "entropy") {
    return ParseBool(flag, v, &f->entropy);
  } else if (flag == "log-sum-sq-probs") {
    return ParseBool(flag, v, &f->log_sum_sq_probs);
  } else if (flag == "mean-logits") {
    return ParseBool(flag, v, &f->mean_logits);
  } else if (flag == "is-top1") {
    return ParseBool(flag, v, &f->is_top1);
  } else if (flag == "topk") {
    return ParseInt32(flag, v, &f->topk);
  } else if (flag == "temperature") {
    float t;
    if (absl::Status s = ParseFloat(flag, v, &t); !s.ok()) return s;
    f->temperature = t;
  } else if (flag == "sampling-top-k") {
    return ParseInt32(flag, v, &f->sampling_top_k);
  } else if (flag == "sampling-top-p") {
    float p;
    if (absl::Status s = ParseFloat(flag, v, &p); !s.ok()) return s;
    f->sampling_top_p = p;
  } else if (flag == "ignore-index") {
    int64_t i;
    if (absl::Status s = ParseInt64(flag, v, &i); !s.ok()) return s;
    f->ignore_index = i;
  } else {
    return std::nullopt;
  }
  return absl::OkStatus();
}

// Applies one "--flag value" of `score`.
absl::Status ApplyScoreFlag(const std::string& flag, const std::string& v, ScoreArgs* a) {
  if (ApplyChannelFlag(flag, v, &a->channel)) return absl::OkStatus();
  if (std::optional<absl::Status> s = ApplyOptionFlag(flag, v, &a->flags)) return *s;
  if (flag == "server") {
    a->server = v;
  } else if (flag == "input") {
    a->input = v;
  } else if (flag == "output") {
    a->output = v;
  } else if (flag == "max-request-bytes") {
    if (absl::Status s = ParseInt64(flag, v, &a->max_request_bytes); !s.ok()) return s;
    if (a->max_request_bytes <= 0) return BadValue(flag, v, "a positive byte count");
  } else if (flag == "timeout") {
    return ParseSeconds(flag, v, &a->timeout_seconds);
  } else if (flag == "chunk-above") {
    return ParseInt64(flag, v, &a->chunking.above_bytes);
  } else if (flag == "piece-bytes") {
    return ParsePositive(flag, v, &a->chunking.piece_bytes);
  } else if (flag == "shared-memory") {
    return ParseBool(flag, v, &a->shared_memory);
  } else if (flag == "head") {
    if (v.empty()) return BadValue(flag, v, "an lm_head name");
    a->head = v;
  } else if (flag == "head-version") {
    if (v.empty()) return BadValue(flag, v, "an lm_head version");
    a->head_version = v;
  } else if (flag == "rollout-logprobs") {
    if (v.empty()) return BadValue(flag, v, "a tensor name of the input file");
    a->rollout_logprobs = v;
  } else if (flag == "sampling-mask") {
    if (v.empty()) return BadValue(flag, v, "the prefix of tensors NAME_offsets and NAME_ids of the input file");
    a->sampling_mask = v;
  } else if (flag == "rollout-ratio-cap") {
    double cap;
    if (!absl::SimpleAtod(v, &cap) || !(cap > 0)) return BadValue(flag, v, "a number > 0 (inf: no truncation)");
    a->flags.rollout_ratio_cap = cap;
  } else if (flag == "rollout-band") {
    const std::vector<std::string> ends = absl::StrSplit(v, ',');
    double low, high;
    if (ends.size() != 2 || !absl::SimpleAtod(ends[0], &low) || !absl::SimpleAtod(ends[1], &high) || !(low >= 0) ||
        !(low < high))
      return BadValue(flag, v, "LOW,HIGH with 0 <= LOW < HIGH");
    a->flags.rollout_band_low = low;
    a->flags.rollout_band_high = high;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("score: unknown flag --", flag));
  }
  return absl::OkStatus();
}

// Applies one "--flag value" of `bench`.
absl::Status ApplyBenchFlag(const std::string& flag, const std::string& v, BenchArgs* a) {
  if (ApplyChannelFlag(flag, v, &a->channel)) return absl::OkStatus();
  if (std::optional<absl::Status> s = ApplyOptionFlag(flag, v, &a->flags)) return *s;
  if (flag == "server") {
    a->server = v;
  } else if (flag == "concurrency") {
    int64_t n;
    if (absl::Status s = ParsePositive(flag, v, &n); !s.ok()) return s;
    if (n > 1024) return BadValue(flag, v, "an integer in [1, 1024]");
    a->concurrency = static_cast<int>(n);
  } else if (flag == "batch") {
    return ParsePositive(flag, v, &a->shape.batch);
  } else if (flag == "seq") {
    return ParsePositive(flag, v, &a->shape.seq);
  } else if (flag == "packed") {
    return ParsePositive(flag, v, &a->shape.packed_tokens);
  } else if (flag == "vocab") {
    return ParsePositive(flag, v, &a->shape.vocab);
  } else if (flag == "hidden-size") {
    return ParsePositive(flag, v, &a->shape.hidden);
  } else if (flag == "chunk-above") {
    return ParseInt64(flag, v, &a->chunking.above_bytes);
  } else if (flag == "piece-bytes") {
    return ParsePositive(flag, v, &a->chunking.piece_bytes);
  } else if (flag == "dtype") {
    if (v == "bf16") {
      a->shape.dtype = v1::BF16;
    } else if (v == "f16") {
      a->shape.dtype = v1::F16;
    } else if (v == "f32") {
      a->shape.dtype = v1::F32;
    } else {
      return BadValue(flag, v, "bf16, f16 or f32");
    }
  } else if (flag == "duration") {
    if (absl::Status s = ParseSeconds(flag, v, &a->duration_seconds); !s.ok()) return s;
    if (a->duration_seconds <= 0) return BadValue(flag, v, "a number of seconds > 0");
  } else if (flag == "requests") {
    return ParsePositive(flag, v, &a->requests);
  } else if (flag == "warmup") {
    return ParseSeconds(flag, v, &a->warmup_seconds);
  } else if (flag == "progress") {
    return ParseSeconds(flag, v, &a->progress_seconds);
  } else if (flag == "timeout") {
    return ParseSeconds(flag, v, &a->timeout_seconds);
  } else if (flag == "metrics-url") {
    a->metrics_url = v;
  } else if (flag == "json") {
    return ParseBool(flag, v, &a->json);
  } else if (flag == "shared-memory") {
    return ParseBool(flag, v, &a->shared_memory);
  } else if (flag == "no-echo") {
    bool no_echo = false;
    if (absl::Status s = ParseBool(flag, v, &no_echo); !s.ok()) return s;
    a->echo = !no_echo;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("bench: unknown flag --", flag));
  }
  return absl::OkStatus();
}

// The switches of the per-token outputs besides entropy.
bool IsOutputSwitch(const std::string& flag) {
  return flag == "log-sum-sq-probs" || flag == "mean-logits" || flag == "is-top1";
}

// Flags that take no value (given alone they mean "true").
bool IsSwitch(CommandLine::Command command, const std::string& flag) {
  if (flag == "entropy" || flag == "shared-memory" || IsOutputSwitch(flag))
    return command != CommandLine::Command::kHealth;
  return command == CommandLine::Command::kBench && (flag == "json" || flag == "no-echo");
}

// Checks the combinations of `bench` flags given (`given` names them).
absl::Status CheckBenchArgs(const BenchArgs& a, const std::set<std::string>& given) {
  if (given.count("packed") && given.count("seq")) {
    return absl::InvalidArgumentError(
        "bench: --packed T and --seq S exclude each other (packed [T, V] or padded [B, S, V])");
  }
  if (given.count("hidden-size") && given.count("vocab")) {
    return absl::InvalidArgumentError("bench: --hidden-size H takes V from the server's lm_head; drop --vocab");
  }
  if (given.count("requests") && given.count("duration")) {
    return absl::InvalidArgumentError("bench: --requests and --duration exclude each other");
  }
  return ValidateBenchShape(a.shape);
}

bool IsHelp(const std::string& arg) { return arg == "--help" || arg == "-h"; }

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(const std::vector<std::string>& args) {
  CommandLine cl;
  if (!args.empty() && args[0] == "help") return cl;  // kHelp
  for (const std::string& a : args) {
    if (IsHelp(a)) return cl;
  }
  if (args.empty()) return absl::InvalidArgumentError("no command given");
  if (args[0] == "--version") {
    if (args.size() > 1) return absl::InvalidArgumentError("--version takes no other arguments");
    cl.command = CommandLine::Command::kVersion;
    return cl;
  }
  const std::string& command = args[0];
  if (command == "health") {
    cl.command = CommandLine::Command::kHealth;
  } else if (command == "score") {
    cl.command = CommandLine::Command::kScore;
  } else if (command == "bench") {
    cl.command = CommandLine::Command::kBench;
  } else if (command == "heads") {
    cl.command = CommandLine::Command::kHeads;
  } else if (command == "update-lm-head") {
    cl.command = CommandLine::Command::kUpdateLmHead;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown command '", command, "' (expected health, score, bench, heads or update-lm-head)"));
  }
  std::set<std::string> given;
  // Applies one flag of the command to *out (its errors name the command).
  const auto apply = [&command](const std::string& flag, const std::string& value, CommandLine* out) {
    absl::Status s;
    switch (out->command) {
      case CommandLine::Command::kHealth:
        s = ApplyHealthFlag(flag, value, &out->health);
        break;
      case CommandLine::Command::kScore:
        s = ApplyScoreFlag(flag, value, &out->score);
        break;
      case CommandLine::Command::kHeads:
      case CommandLine::Command::kUpdateLmHead:
        s = ApplyLmHeadFlag(flag, value, &out->lm_head);
        if (!s.ok()) s = absl::InvalidArgumentError(absl::StrCat(command, ": ", s.message()));
        break;
      default:
        s = ApplyBenchFlag(flag, value, &out->bench);
        break;
    }
    return s;
  };

  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string flag = arg.substr(2);
    std::string value;
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (IsSwitch(cl.command, flag)) {
      value = "true";
    } else {
      // Nothing (or another flag) follows: a misspelled flag says so,
      // rather than that it needs a value.
      if (i + 1 >= args.size() || absl::StartsWith(args[i + 1], "--")) {
        CommandLine scratch = cl;
        const absl::Status probe = apply(flag, "", &scratch);
        if (absl::StrContains(probe.message(), "unknown flag --")) return probe;
      }
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat(command, ": --", flag, " needs a value"));
      }
      value = args[++i];
    }
    if (absl::Status s = apply(flag, value, &cl); !s.ok()) return s;
    given.insert(flag);
  }

  const bool health = cl.command == CommandLine::Command::kHealth;
  const bool score = cl.command == CommandLine::Command::kScore;
  const bool lm_head = cl.command == CommandLine::Command::kHeads || cl.command == CommandLine::Command::kUpdateLmHead;
  std::string& server = health    ? cl.health.server
                        : score   ? cl.score.server
                        : lm_head ? cl.lm_head.server
                                  : cl.bench.server;
  if (server.empty()) return absl::InvalidArgumentError(command + ": --server is required");
  absl::StatusOr<std::string> target = CheckTarget(server, "--server");
  if (!target.ok()) return absl::InvalidArgumentError(absl::StrCat(command, ": ", target.status().message()));
  server = *std::move(target);
  const ChannelOptions& channel = health    ? cl.health.channel
                                  : score   ? cl.score.channel
                                  : lm_head ? cl.lm_head.channel
                                            : cl.bench.channel;
  if (channel.tls_cert.empty() != channel.tls_key.empty()) {
    return absl::InvalidArgumentError(command + ": --tls-cert and --tls-key go together");
  }
  if (cl.command == CommandLine::Command::kScore) {
    if (cl.score.input.empty()) return absl::InvalidArgumentError("score: --input is required");
    if (cl.score.output.empty()) return absl::InvalidArgumentError("score: --output is required");
  }
  if (cl.command == CommandLine::Command::kBench) {
    if (absl::Status s = CheckBenchArgs(cl.bench, given); !s.ok()) return s;
  }
  if (cl.command == CommandLine::Command::kUpdateLmHead) {
    for (const auto& [flag, value] : {std::pair<const char*, const std::string&>{"head", cl.lm_head.head},
                                      {"version", cl.lm_head.version},
                                      {"input", cl.lm_head.input}})
      if (value.empty()) return absl::InvalidArgumentError(absl::StrCat("update-lm-head: --", flag, " is required"));
  }
  return cl;
}

std::string UsageText() {
  return R"(usage:
  logprob-client --version
      Prints the version and whether this build has the CUDA backend.

  logprob-client heads --server HOST:PORT [security options]
      Lists the server's lm_heads: name, current and retained versions,
      shape, dtype, GEMM precision, sha256, source, logit transform (bias,
      logit_scale, final_logit_softcapping, or none).

  logprob-client update-lm-head --server HOST:PORT --head NAME --version V
      --input PATH [--tensor NAME] [--sha256 HEX] [--rows-per-call N]
      [--timeout SECONDS] [--update-token-file FILE] [security options]
      Replaces lm_head NAME by the weight in PATH (a .safetensors file, a
      model.safetensors.index.json or a checkpoint directory; TENSOR as the
      server's --lm-head: lm_head.weight, then model.embed_tokens.weight) as
      version V; progress on stderr. The server must run with
      --allow-lm-head-updates. --update-token-file: the server's update
      token (its --update-token-file), sent instead of --auth-token-file's
      (`heads` takes it too). Exit 0 once committed, 1 if the server
      refused (the update is aborted), 2 on a bad command line or file.

  logprob-client health --server HOST:PORT [--wait SECONDS] [security options]
      Exit 0 once the server reports SERVING (grpc.health.v1), trying every
      200 ms for up to SECONDS (default 0: one try); else exit 1.

  logprob-client score --server HOST:PORT --input IN.safetensors
      --output OUT.safetensors [options] [security options]
      Scores `logits` or `hidden_states` with `input_ids` (and `cu_seqlens`,
      `seq_lens`, `gather_indices` when present) from IN, writes the outputs
      (token_logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1,
      topk_logprobs, topk_indices, gathered_logprobs) to OUT. Exit 0 on
      success, 1 on a server error, 2 on a bad command line or input file.
    --alignment next_token|same_position   (default next_token)
    --entropy                   also return per-token entropy
    --log-sum-sq-probs          also return log(sum_v p_v^2) per token (F32)
    --mean-logits               also return the mean of logits / T over the
                                vocabulary per token, before the filters (F32)
    --is-top1                   also return whether the target is the argmax
                                (I32 0/1; lowest id among equal maxima)
    --topk K                    return the K largest logprobs and their ids
    --temperature T             softmax temperature (> 0; default 1)
    --sampling-top-k K          sampling filter top-k (0 disables)
    --sampling-top-p P          sampling filter top-p (1 disables)
    --ignore-index I            target id scored as 0 (default -100)
    --max-request-bytes N       request size limit (default: the server's);
                                larger inputs are split by sequences
    --chunk-above N             send requests over N bytes as a stream of
                                pieces (ScoreChunked; default 8388608 = 8 MiB;
                                -1: always one Score message)
    --piece-bytes N             bytes per piece (default 2097152 = 2 MiB)
    --timeout SECONDS           deadline of each call (default: none)
    --shared-memory             send the tensors through a POSIX shared-memory
                                region registered with the server (same host
                                only; an error if the server cannot use it)
    --head NAME                 hidden_states: score with the server's lm_head
                                NAME (see heads; default: "default", or the
                                server's only head)
    --head-version V            hidden_states: score with version V of that
                                head (one it retains; default: its current
                                version; a split request is scored by one
                                version in any case)
    --rollout-logprobs NAME     send IN's F32 tensor NAME (shaped like
                                token_logprobs, NaN where the rollout engine
                                has none) as rollout_logprobs: OUT also gets
                                rollout_log_ratio, rollout_ratio and the
                                rollout_seq_* outputs, and the request's
                                figures are printed and stored in OUT's
                                metadata (docs/SPEC.md "Rollout mismatch")
    --rollout-ratio-cap C       cap of rollout_ratio (> 0; default 3)
    --rollout-band LOW,HIGH     band of r counted as outside (default 0.9,1.1)
    --sampling-mask NAME        send IN's NAME_offsets [n + 1] and NAME_ids
                                [nnz] (the sampler's kept ids of each output
                                position, CSR) as the sampling mask: scores
                                are renormalised over exactly those ids
                                (docs/SPEC.md "Sampling masks")

  logprob-client bench --server HOST:PORT [shape] [options] [load options]
      [security options]
      Load generator: CONCURRENCY threads send one synthetic request (random
      logits and targets) back to back, first to the server, then to an
      in-process echo server on 127.0.0.1 that answers with a copy of the
      server's reply (gRPC transfer of the same request and reply bytes,
      no scoring). Prints requests/s, tokens/s, request MB/s, latency
      mean/p50/p90/p99/max and scoring / echo throughput; progress goes to
      stderr. Exit 0 if every call succeeded, 1 otherwise, 2 on a bad
      command line or a request over the server's max_request_bytes.
    shape: --batch B (default 4) --seq S (default 512) --vocab V (default
           32000) --dtype bf16|f16|f32 (default bf16): padded [B, S, V];
           or --packed T with --batch B: packed [T, V], B sequences;
           --hidden-size H: hidden_states [B, S, H] / [T, H] instead of
           logits (the server needs an lm_head of that H; V is its V)
    --chunk-above N, --piece-bytes N
                                as for score: requests over N bytes go in
                                pieces (ScoreChunked); the echo phases
                                report both ways ("echo", "echo-chunked")
    options: as for score (--entropy, --topk K, --temperature T, ...)
    --concurrency N             calls in flight (default 1)
    --duration SECONDS          measured time per phase (default 10)
    --requests N                or: N measured calls per phase
    --warmup SECONDS            unmeasured calls before each phase (default 1)
    --no-echo                   skip the echo phase
    --shared-memory             scoring phase sends the tensors through a
                                registered shared-memory region (same host);
                                the echo phase still sends the bytes
    --metrics-url URL           the server's /metrics (http://HOST:PORT/metrics,
                                see --metrics-listen): adds the server's
                                time split (queue/validation, dispatch, compute)
    --json                      one JSON object on stdout instead of the table
    --progress SECONDS          progress line interval on stderr (default 5; 0: none)
    --timeout SECONDS           deadline of each call (default: none)

  security options (all commands):
    --tls-ca FILE               connect with TLS, verifying the server's
                                certificate with this PEM CA
    --tls-cert FILE --tls-key FILE
                                PEM client certificate and key (mutual TLS)
    --tls-server-name NAME      name to verify in the server's certificate
                                (default: the host of --server)
    --auth-token-file FILE      send "authorization: Bearer TOKEN" (the file's
                                content, whitespace trimmed) on every call
)";
}

}  // namespace logprob::client
