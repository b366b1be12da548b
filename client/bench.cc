#include "client/bench.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/bench_report.h"
#include "client/commands.h"
#include "client/echo_service.h"
#include "client/metrics_scrape.h"
#include "client/shm_inputs.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace logprob::client {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

Clock::time_point After(Clock::time_point t, double seconds) {
  return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// How one phase's calls are made and when they stop.
struct LoadPlan {
  int concurrency = 1;
  double warmup_seconds = 0;
  double duration_seconds = 0;  // used when requests == 0
  int64_t requests = 0;
  double timeout_seconds = 0;
  double progress_seconds = 0;
};

// Tallies of the calls of a phase, shared by its client threads.
struct Tally {
  std::atomic<int64_t> ok{0};
  std::atomic<int64_t> failed{0};
  absl::Mutex mu;
  std::vector<double> latencies ABSL_GUARDED_BY(mu);
  std::map<std::string, int64_t> failures ABSL_GUARDED_BY(mu);
  std::string first_error ABSL_GUARDED_BY(mu);
};

// Prints a progress line to stderr every `interval` seconds until stopped.
class ProgressPrinter {
 public:
  ProgressPrinter(std::string phase, double interval, const Tally& tally)
      : phase_(std::move(phase)), interval_(interval), tally_(tally) {
    if (interval_ > 0) thread_ = std::thread([this] { Loop(); });
  }
  ~ProgressPrinter() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      cv_.SignalAll();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    const Clock::time_point start = Clock::now();
    absl::MutexLock lock(&mu_);
    int64_t last_ok = 0;
    Clock::time_point last = start;
    for (;;) {
      const absl::Time until = absl::Now() + absl::Seconds(interval_);
      while (!stop_ && absl::Now() < until) cv_.WaitWithDeadline(&mu_, until);
      if (stop_) break;
      const int64_t ok = tally_.ok.load();
      const double window = SecondsSince(last);
      std::cerr << absl::StrFormat("bench %s: %.1f s, %d OK (%.2f/s over the last %.1f s), %d failed\n", phase_,
                                   SecondsSince(start), ok, window > 0 ? (ok - last_ok) / window : 0.0, window,
                                   tally_.failed.load())
                << std::flush;
      last_ok = ok;
      last = Clock::now();
    }
  }

  const std::string phase_;
  const double interval_;
  const Tally& tally_;
  absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when stop_ is set
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Runs `threads` threads, each calling `call` back to back while `more()`
// says so; returns once all have finished.
void RunThreads(int threads, const std::function<bool()>& more, const std::function<void()>& call) {
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&] {
      while (more()) call();
    });
  }
  for (std::thread& t : pool) t.join();
}

// Where a phase sends its calls: a unary Score on `stub`, or ScoreChunked
// on `channel` in pieces of `piece_bytes` when `chunked`.
struct Target {
  v1::LogprobService::Stub* stub = nullptr;
  std::shared_ptr<grpc::Channel> channel;
  bool chunked = false;
  int64_t piece_bytes = 0;
  const ShmInputs* shm = nullptr;  // the session whose region the request references (unary only)
};

// One call of `request` to `target`, recorded in `tally` when set.
void CallOnce(const Target& target, const v1::ScoreRequest& request, double timeout_seconds, Tally* tally) {
  const Clock::time_point t0 = Clock::now();
  absl::Status status;
  if (target.chunked) {
    status = ScoreChunked(target.channel, request, target.piece_bytes, timeout_seconds).status();
  } else {
    grpc::ClientContext context;
    SetTimeout(&context, timeout_seconds);
    if (target.shm != nullptr) target.shm->Attach(&context);
    AnnounceRequestBytes(&context, request);
    v1::ScoreResponse reply;
    status = FromGrpc(target.stub->Score(&context, request, &reply));
  }
  const double seconds = SecondsSince(t0);
  if (tally == nullptr) return;
  if (status.ok()) {
    tally->ok.fetch_add(1);
    absl::MutexLock lock(&tally->mu);
    tally->latencies.push_back(seconds);
    return;
  }
  tally->failed.fetch_add(1);
  absl::MutexLock lock(&tally->mu);
  ++tally->failures[absl::StatusCodeToString(status.code())];
  if (tally->first_error.empty()) tally->first_error = status.ToString();
}

// Warm-up (every thread makes at least one call when warmup_seconds > 0),
// then the measured calls of one phase. `before_measuring` runs between.
PhaseResult RunPhase(const std::string& name, const Target& target, const v1::ScoreRequest& request,
                     const LoadPlan& plan, const std::function<void()>& before_measuring) {
  if (plan.warmup_seconds > 0) {
    const Clock::time_point end = After(Clock::now(), plan.warmup_seconds);
    RunThreads(
        plan.concurrency, [&] { return Clock::now() < end; },
        [&] { CallOnce(target, request, plan.timeout_seconds, nullptr); });
  }
  if (before_measuring) before_measuring();

  Tally tally;
  std::atomic<int64_t> claimed{0};
  const Clock::time_point start = Clock::now();
  const Clock::time_point end = After(start, plan.duration_seconds);
  {
    ProgressPrinter progress(name, plan.progress_seconds, tally);
    RunThreads(
        plan.concurrency, [&] { return plan.requests > 0 ? claimed.fetch_add(1) < plan.requests : Clock::now() < end; },
        [&] { CallOnce(target, request, plan.timeout_seconds, &tally); });
  }
  PhaseResult result;
  result.name = name;
  result.seconds = SecondsSince(start);
  result.ok = tally.ok.load();
  result.failed = tally.failed.load();
  {
    absl::MutexLock lock(&tally.mu);  // the threads have ended; the lock documents it
    result.failures = std::move(tally.failures);
    result.first_error = std::move(tally.first_error);
    result.latency = Summarize(std::move(tally.latencies));
  }
  return result;
}

// Histogram totals of the server's timings in one /metrics scrape.
struct ServerTimings {
  HistogramTotals request, queue, worker_call, compute;
};

absl::StatusOr<ServerTimings> ScrapeTimings(const std::string& url, const std::string& method) {
  LOGPROB_ASSIGN_OR_RETURN(const std::string text, HttpGet(url));
  return ServerTimings{ParseHistogramTotals(text, "logprob_request_duration_seconds", "method=\"" + method + "\""),
                       ParseHistogramTotals(text, "logprob_queue_duration_seconds"),
                       ParseHistogramTotals(text, "logprob_worker_call_duration_seconds"),
                       ParseHistogramTotals(text, "logprob_compute_duration_seconds")};
}

double MeanOfDelta(const HistogramTotals& before, const HistogramTotals& after) {
  const double n = after.count - before.count;
  return n > 0 ? (after.sum - before.sum) / n : 0;
}

ServerSplit SplitOf(const ServerTimings& before, const ServerTimings& after) {
  ServerSplit s;
  s.requests = after.request.count - before.request.count;
  s.request_mean = MeanOfDelta(before.request, after.request);
  s.queue_mean = MeanOfDelta(before.queue, after.queue);
  s.batches = after.worker_call.count - before.worker_call.count;
  s.worker_call_mean = MeanOfDelta(before.worker_call, after.worker_call);
  s.compute_mean = MeanOfDelta(before.compute, after.compute);
  return s;
}

}  // namespace

int RunBench(const BenchArgs& args) {
  std::shared_ptr<grpc::Channel> channel = OpenChannel(args.server, args.channel);
  if (!channel) return kExitBadInput;
  std::unique_ptr<v1::LogprobService::Stub> stub = v1::LogprobService::NewStub(channel);

  // The server's limits and lm_head, then the request and one probe call
  // whose reply the echo sends back.
  absl::StatusOr<v1::ServerInfo> server_info = FetchServerInfo(*stub, args.timeout_seconds);
  if (!server_info.ok()) {
    PrintError(server_info.status());
    return kExitFailure;
  }
  const v1::ServerInfo& info = *server_info;
  BenchShape shape = args.shape;
  if (shape.hidden > 0) {
    if (info.hidden_size() == 0) {
      PrintError(absl::InvalidArgumentError(absl::StrCat("--hidden-size ", shape.hidden, ": the server ", args.server,
                                                         " has no lm_head (start logprob-server with --lm-head)")));
      return kExitBadInput;
    }
    if (info.hidden_size() != shape.hidden) {
      PrintError(absl::InvalidArgumentError(absl::StrCat("--hidden-size ", shape.hidden, ": the server's lm_head is [",
                                                         info.vocab_size(), ", ", info.hidden_size(),
                                                         "] (H = ", info.hidden_size(), ")")));
      return kExitBadInput;
    }
    shape.vocab = info.vocab_size();
  }
  absl::StatusOr<v1::ScoreRequest> request =
      BuildBenchRequest(shape, ToScoreOptions(args.flags), absl::StrCat("bench-", getpid()));
  if (!request.ok()) {
    PrintError(request.status());
    return kExitBadInput;
  }
  BenchReport report;
  report.server = args.server;
  report.shape = shape;
  report.options = request->options();
  report.concurrency = args.concurrency;
  report.request_bytes = static_cast<int64_t>(request->ByteSizeLong());  // also caches the size before threads share it
  report.tokens_per_request = ShapeTokens(shape);
  // Shared-memory requests carry references only: always one Score message.
  report.chunked = !args.shared_memory && UseChunked(args.chunking, report.request_bytes);
  const std::string method = report.chunked ? "ScoreChunked" : "Score";
  Target scoring{stub.get(), channel, report.chunked, args.chunking.piece_bytes};

  if (info.max_request_bytes() > 0 && report.request_bytes > info.max_request_bytes()) {
    PrintError(absl::InvalidArgumentError(
        absl::StrCat("--batch/--seq/--packed/--vocab/--hidden-size/--dtype: the request is ", report.request_bytes,
                     " bytes, over the server's max_request_bytes ", info.max_request_bytes(),
                     "; use a smaller shape or start logprob-server with a larger --max-request-bytes")));
    return kExitBadInput;
  }
  std::optional<ServerTimings> before;
  if (!args.metrics_url.empty()) {
    // Scraped once here so that a wrong URL fails before any load is sent.
    absl::StatusOr<ServerTimings> t = ScrapeTimings(args.metrics_url, method);
    if (!t.ok()) {
      PrintError(t.status());
      return kExitBadInput;
    }
  }
  // --shared-memory: the scoring phase sends `placed`, whose tensors lie
  // in a region registered once (every call reads the same bytes).
  std::unique_ptr<ShmInputs> shm;
  v1::ScoreRequest placed;
  if (args.shared_memory) {
    if (!SameSharedMemoryHost(info)) {
      PrintError(absl::FailedPreconditionError(
          "--shared-memory: the server has shared-memory inputs off or does not share this host's /dev/shm"));
      return kExitFailure;
    }
    shm = std::make_unique<ShmInputs>(*stub, args.timeout_seconds);
    placed = *request;
    if (absl::Status st = shm->Place(&placed); !st.ok()) {
      PrintError(st);
      return kExitFailure;
    }
    placed.ByteSizeLong();  // caches the size before threads share it
  }
  const v1::ScoreRequest& scored = shm ? placed : *request;
  scoring.shm = shm.get();
  v1::ScoreResponse probe_reply;
  {
    absl::StatusOr<v1::ScoreResponse> probe;
    if (report.chunked) {
      probe = ScoreChunked(channel, *request, args.chunking.piece_bytes, args.timeout_seconds);
    } else {
      grpc::ClientContext context;
      SetTimeout(&context, args.timeout_seconds);
      if (shm) shm->Attach(&context);
      AnnounceRequestBytes(&context, scored);
      probe = v1::ScoreResponse();
      if (const grpc::Status s = stub->Score(&context, scored, &*probe); !s.ok()) probe = FromGrpc(s);
    }
    if (!probe.ok()) {
      PrintError(absl::Status(probe.status().code(), absl::StrCat("probe request: ", probe.status().message())));
      return kExitFailure;
    }
    probe_reply = *std::move(probe);
  }
  report.reply_bytes = static_cast<int64_t>(probe_reply.ByteSizeLong());

  LoadPlan plan;
  plan.concurrency = args.concurrency;
  plan.warmup_seconds = args.warmup_seconds;
  plan.duration_seconds = args.duration_seconds;
  plan.requests = args.requests;
  plan.timeout_seconds = args.timeout_seconds;
  plan.progress_seconds = args.progress_seconds;

  report.scoring = RunPhase("scoring", scoring, scored, plan, [&] {
    if (args.metrics_url.empty()) return;
    absl::StatusOr<ServerTimings> t = ScrapeTimings(args.metrics_url, method);
    if (t.ok()) before = *t;
    else std::cerr << "warning: no server-side split: " << t.status() << std::endl;
  });
  if (before) {
    absl::StatusOr<ServerTimings> after = ScrapeTimings(args.metrics_url, method);
    if (after.ok()) {
      report.split = SplitOf(*before, *after);
    } else {
      std::cerr << "warning: no server-side split: " << after.status() << std::endl;
    }
  }

  if (args.echo) {
    const int limit = info.max_request_bytes() > 0 ? static_cast<int>(info.max_request_bytes())
                                                   : static_cast<int>(kDefaultMaxRequestBytes);
    absl::StatusOr<std::unique_ptr<EchoServer>> echo = EchoServer::Start(probe_reply, limit);
    if (!echo.ok()) {
      PrintError(echo.status());
      return kExitFailure;
    }
    std::shared_ptr<grpc::Channel> echo_channel = MakeChannel((*echo)->address());
    std::unique_ptr<v1::LogprobService::Stub> echo_stub = v1::LogprobService::NewStub(echo_channel);
    report.echo = RunPhase("echo", Target{echo_stub.get(), echo_channel, false, 0}, *request, plan, nullptr);
    report.echo_chunked =
        RunPhase("echo-chunked", Target{echo_stub.get(), echo_channel, true, args.chunking.piece_bytes}, *request, plan,
                 nullptr);
  }

  std::cout << (args.json ? FormatBenchJson(report) : FormatBenchTable(report)) << std::flush;
  const bool all_ok = report.scoring.failed == 0 && (!report.echo || report.echo->failed == 0) &&
                      (!report.echo_chunked || report.echo_chunked->failed == 0);
  return all_ok ? kExitOk : kExitFailure;
}

}  // namespace logprob::client
