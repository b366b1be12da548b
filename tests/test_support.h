// Shared helpers of the integration tests: a live logprob-server process
// on loopback, golden cases and their comparison (docs/SPEC.md
// tolerance 2e-4 + 2e-5 * |expected|, ids exact, -inf where expected).
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "grpcpp/channel.h"
#include "logprob/v1/logprob.grpc.pb.h"

namespace logprob::testing {

/// Folder of the golden cases copied into the repository.
/// True when this build runs under AddressSanitizer or ThreadSanitizer
/// (scripts/sanitize.sh): memory measurements (RSS) are then meaningless.
constexpr bool kUnderSanitizer =
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    true;
#else
    false;
#endif

std::string GoldenDir();
/// Folder of the built programs (logprob-server, logprob-worker, ...).
std::string BinDir();
/// A TCP port on 127.0.0.1 that was free a moment ago.
int FreePort();

/// Starts `args` (args[0] the program's path) as a child process with this
/// process's environment, its stderr appended to `stderr_path` when given;
/// -1 (and a test failure) if it cannot.
pid_t SpawnProcess(const std::vector<std::string>& args, const std::string& stderr_path = "");

/// A logprob-server child process with its own local worker pool.
class ServerProcess {
 public:
  /// Starts `logprob-server --listen 127.0.0.1:PORT` plus `args` and does
  /// not wait for health (e.g. cluster mode, NOT_SERVING until workers
  /// join). Null (and a test failure) if it cannot be started.
  static std::unique_ptr<ServerProcess> Launch(const std::vector<std::string>& args,
                                               const std::string& stderr_path = "");
  /// Starts `logprob-server --listen 127.0.0.1:PORT --workers N` plus
  /// `extra` flags and waits (up to 60 s) until health reports SERVING.
  /// Fails the current test (and returns null) if it does not.
  static std::unique_ptr<ServerProcess> Start(int workers, const std::vector<std::string>& extra = {});
  /// Makes a channel to an address ("127.0.0.1:PORT").
  using ChannelFactory = std::function<std::shared_ptr<grpc::Channel>(const std::string& address)>;
  /// As above, but waits for health on the channel `wait_channel` makes
  /// (e.g. with TLS credentials, for a server started with --tls-cert), and
  /// appends the server's (and its workers') stderr to `stderr_path` when
  /// given.
  static std::unique_ptr<ServerProcess> Start(int workers, const std::vector<std::string>& extra,
                                              const ChannelFactory& wait_channel, const std::string& stderr_path = "");
  ~ServerProcess();  // SIGTERM, then wait

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }
  std::unique_ptr<v1::LogprobService::Stub> NewStub() const;
  /// True while the process has not exited.
  bool Alive() const;
  /// Pids of its live child processes (the local workers).
  std::vector<pid_t> WorkerPids() const;
  /// Sends `sig` and waits for the process; returns its exit status
  /// (exit code, or 128 + signal).
  int SignalAndWait(int sig);

 private:
  std::string address_;
  pid_t pid_ = -1;
};

/// A pool secret file for cluster-mode tests (--internal-secret-file of
/// the front-end and of its workers): made once per test process in
/// TempDir(), mode 0600; its path.
std::string PoolSecretFile();

/// The TCP ports processes `pids` listen on (their sockets in LISTEN state,
/// from /proc/PID/fd and /proc/net/tcp{,6}), sorted.
std::vector<int> ListeningPorts(const std::vector<pid_t>& pids);

/// Peak resident set size of process `pid` (VmHWM of /proc/PID/status),
/// bytes; -1 if it cannot be read.
int64_t PeakRssBytes(pid_t pid);

/// Exit code and combined stdout + stderr of a shell command.
struct CommandResult {
  int code;
  std::string output;
};
/// Runs `cmd` with /bin/sh and waits for it.
CommandResult RunCommand(const std::string& cmd);

/// Scrapes http://127.0.0.1:PORT/metrics with curl (output: the exposition).
CommandResult ScrapeMetrics(int port);
/// The value of the sample whose line starts with `series` (metric name
/// plus its exact label set as the exposition prints it, e.g.
/// `logprob_workers_up` or `logprob_requests_total{code="OK",method="Score"}`),
/// or -1 if there is none.
double MetricSample(const std::string& scrape, const std::string& series);

/// How long a test waits for a state it needs before failing: generous,
/// so that a loaded 2-core machine is merely slow, never a failure.
constexpr std::chrono::seconds kWaitTimeout{120};

/// Polls `condition` (every 50 ms) until it returns true or `timeout`
/// passes: how tests wait for an observed state (a metric, health, a
/// process), never for a fixed time. Failure names `what` and the timeout.
/// Use as ASSERT_TRUE(WaitUntil("...", [&] { return ...; })).
::testing::AssertionResult WaitUntil(const std::string& what, const std::function<bool()>& condition,
                                     std::chrono::milliseconds timeout = kWaitTimeout);

/// WaitUntil the /metrics sample `series` (MetricSample) on `port` equals
/// `value`; the failure also gives the last value seen (-1: none).
::testing::AssertionResult WaitForMetric(int port, const std::string& series, double value,
                                         std::chrono::milliseconds timeout = kWaitTimeout);

/// A packed hidden-states request: T random bf16 rows [T, H] (normal(0,1)),
/// random targets in [0, V), one sequence, entropy on.
v1::ScoreRequest RandomHiddenRequest(int64_t T, int64_t H, int64_t V, uint32_t seed);
/// The same for any input tensor: `input` ("logits" or "hidden_states")
/// [T, width] bf16 normal(0, 1), targets in [0, V), entropy on.
v1::ScoreRequest RandomPackedRequest(const std::string& input, int64_t T, int64_t width, int64_t V, uint32_t seed);
/// Writes a safetensors file with `lm_head.weight` [V, H] bf16, normal(0, 0.05).
absl::Status WriteRandomLmHead(const std::string& path, int64_t V, int64_t H, uint32_t seed);

/// Hidden-states workload of the live-server tests that need requests
/// lasting seconds: a random bf16 lm_head [v, h] in a per-process file
/// (ctest runs tests in parallel processes; removed by the destructor) and
/// two requests built once (RandomHiddenRequest, seeds seed + 1 and + 2).
struct HiddenWorkload {
  /// `tag` names the file (TempDir()/TAG_lm_head.PID.safetensors).
  HiddenWorkload(const std::string& tag, int64_t v, int64_t h, uint32_t seed, int64_t slow_tokens,
                 int64_t quick_tokens);
  ~HiddenWorkload();
  std::string lm_head;    // path for --lm-head
  v1::ScoreRequest slow;  // keeps the workers busy for seconds
  v1::ScoreRequest quick;
};

/// A golden case: inputs, expected outputs and the options from metadata.
struct GoldenCase {
  std::string name;
  SafetensorsFile inputs;
  SafetensorsFile expected;
  v1::ScoreOptions options;
};

/// Loads NAME.safetensors and NAME.expected.safetensors from GoldenDir().
GoldenCase LoadGolden(const std::string& name);
/// The logits golden cases (not hidden-states).
std::vector<std::string> LogitsGoldenNames();
/// The hidden-states golden cases of heads with a logit transform and a
/// bias (tests/data/golden/make_head_transforms.py: transformers' Gemma-2
/// softcap, Cohere's logit scale), expected values from transformers'
/// forward passes in float64.
std::vector<std::string> TransformGoldenNames();
/// The `--lm-head` path of a hidden-states golden case (its inputs'
/// metadata "lm_head", under GoldenDir(): a file, or a checkpoint directory
/// with config.json); "" when it names none.
std::string GoldenLmHead(const GoldenCase& c);
/// Scores every TransformGoldenNames case on a server of 1 and then 2
/// workers (`logprob-server --parallelism vocab --lm-head GoldenLmHead(c)`
/// plus `extra` flags) and expects its golden outputs (CompareOutputs).
void ExpectTransformGoldensMatch(const std::vector<std::string>& extra);
/// The ScoreRequest of a golden case (all its input tensors).
v1::ScoreRequest GoldenRequest(const GoldenCase& c);

/// Scores golden case `c` on `stub` (a fresh context, no deadline); the
/// response goes to *resp.
grpc::Status ScoreGolden(v1::LogprobService::Stub& stub, const GoldenCase& c, v1::ScoreResponse* resp);

/// The server's GetServerInfo answer (a fresh context); a failed call is a
/// test failure and gives an empty ServerInfo.
v1::ServerInfo Info(v1::LogprobService::Stub& stub);

/// The logprob-client flags that carry a golden case's options
/// (" --entropy --topk 5 ...", each with a leading space).
std::string CliOptionFlags(const GoldenCase& c);

/// Compares `got` with `expected` tensor by tensor (every expected output
/// must be present with the same shape). Returns "" or a description of
/// the first mismatches.
std::string CompareOutputs(const std::vector<v1::Tensor>& expected, const std::vector<v1::Tensor>& got);

/// Float values of an F32 tensor.
std::vector<float> Floats(const v1::Tensor& t);
/// The output called `name`, or nullptr.
const v1::Tensor* FindOutput(const v1::ScoreResponse& r, const std::string& name);

}  // namespace logprob::testing
