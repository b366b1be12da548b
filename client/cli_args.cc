#include "client/cli_args.h"

#include <cmath>
#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace logprob::client {
namespace {

absl::Status BadValue(const std::string& flag, const std::string& value, const char* what) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": '", value, "' is not ", what));
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

// Applies a "--flag value" shared by both commands (TLS, bearer token);
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

// Applies one "--flag value" of `score`.
absl::Status ApplyScoreFlag(const std::string& flag, const std::string& v, ScoreArgs* a) {
  ScoreFlags& f = a->flags;
  if (ApplyChannelFlag(flag, v, &a->channel)) return absl::OkStatus();
  if (flag == "server") {
    a->server = v;
  } else if (flag == "input") {
    a->input = v;
  } else if (flag == "output") {
    a->output = v;
  } else if (flag == "alignment") {
    absl::StatusOr<v1::Alignment> alignment = ParseAlignment(v);
    if (!alignment.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--alignment: ", alignment.status().message()));
    }
    f.alignment = *alignment;
  } else if (flag == "entropy") {
    if (v == "true" || v == "1") {
      f.entropy = true;
    } else if (v == "false" || v == "0") {
      f.entropy = false;
    } else {
      return BadValue(flag, v, "true or false");
    }
  } else if (flag == "topk") {
    return ParseInt32(flag, v, &f.topk);
  } else if (flag == "temperature") {
    float t;
    if (absl::Status s = ParseFloat(flag, v, &t); !s.ok()) return s;
    f.temperature = t;
  } else if (flag == "sampling-top-k") {
    return ParseInt32(flag, v, &f.sampling_top_k);
  } else if (flag == "sampling-top-p") {
    float p;
    if (absl::Status s = ParseFloat(flag, v, &p); !s.ok()) return s;
    f.sampling_top_p = p;
  } else if (flag == "ignore-index") {
    int64_t i;
    if (absl::Status s = ParseInt64(flag, v, &i); !s.ok()) return s;
    f.ignore_index = i;
  } else if (flag == "max-request-bytes") {
    if (absl::Status s = ParseInt64(flag, v, &a->max_request_bytes); !s.ok()) return s;
    if (a->max_request_bytes <= 0) return BadValue(flag, v, "a positive byte count");
  } else if (flag == "timeout") {
    return ParseSeconds(flag, v, &a->timeout_seconds);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("score: unknown flag --", flag));
  }
  return absl::OkStatus();
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
  const std::string& command = args[0];
  if (command == "health") {
    cl.command = CommandLine::Command::kHealth;
  } else if (command == "score") {
    cl.command = CommandLine::Command::kScore;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown command '", command, "' (expected health or score)"));
  }

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
    } else if (flag == "entropy") {
      value = "true";
    } else {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", flag, " needs a value"));
      }
      value = args[++i];
    }
    const absl::Status s = cl.command == CommandLine::Command::kHealth
                               ? ApplyHealthFlag(flag, value, &cl.health)
                               : ApplyScoreFlag(flag, value, &cl.score);
    if (!s.ok()) return s;
  }

  const std::string& server =
      cl.command == CommandLine::Command::kHealth ? cl.health.server : cl.score.server;
  if (server.empty()) return absl::InvalidArgumentError(command + ": --server is required");
  const ChannelOptions& channel =
      cl.command == CommandLine::Command::kHealth ? cl.health.channel : cl.score.channel;
  if (channel.tls_cert.empty() != channel.tls_key.empty()) {
    return absl::InvalidArgumentError(command + ": --tls-cert and --tls-key go together");
  }
  if (cl.command == CommandLine::Command::kScore) {
    if (cl.score.input.empty()) return absl::InvalidArgumentError("score: --input is required");
    if (cl.score.output.empty()) return absl::InvalidArgumentError("score: --output is required");
  }
  return cl;
}

std::string UsageText() {
  return R"(usage:
  logprob-client health --server HOST:PORT [--wait SECONDS] [security options]
      Exit 0 once the server reports SERVING (grpc.health.v1), trying every
      200 ms for up to SECONDS (default 0: one try); else exit 1.

  logprob-client score --server HOST:PORT --input IN.safetensors
      --output OUT.safetensors [options] [security options]
      Scores `logits` or `hidden_states` with `input_ids` (and `cu_seqlens`,
      `seq_lens`, `gather_indices` when present) from IN, writes the outputs
      (token_logprobs, entropy, topk_logprobs, topk_indices,
      gathered_logprobs) to OUT. Exit 0 on success, 1 on a server error,
      2 on a bad command line or input file.
    --alignment next_token|same_position   (default next_token)
    --entropy                   also return per-token entropy
    --topk K                    return the K largest logprobs and their ids
    --temperature T             softmax temperature (> 0; default 1)
    --sampling-top-k K          sampling filter top-k (0 disables)
    --sampling-top-p P          sampling filter top-p (1 disables)
    --ignore-index I            target id scored as 0 (default -100)
    --max-request-bytes N       request size limit (default: the server's);
                                larger inputs are split by sequences
    --timeout SECONDS           deadline of each call (default: none)

  security options (both commands):
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
