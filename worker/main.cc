// logprob-worker: one scoring worker process (CPU or CUDA backend, Gloo
// or NCCL communicator).
//
// Joins the front-end's control plane (--frontend) and waits there for its
// rank, loads its vocabulary slice of the lm_head when the front-end has
// one (uploaded once to the GPU with --backend cuda), forms the
// communicator through the front-end's store (Gloo rendezvous, or rank 0's
// NCCL unique id), serves
// the internal Worker service and reports Ready with its address. The Join
// stream stays open while this worker belongs to the pool; when it ends
// (the pool was reset after a peer failed, or the front-end went away) the
// worker re-executes itself and joins again (--rejoin, the default), or
// exits (--rejoin=false, as the front-end's locally spawned workers do).
// A front-end of another release (another kWorkerProtocolVersion,
// common/worker_protocol.h) refuses the join: the worker then exits with
// status 1, whatever --rejoin says.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "common/backend_choice.h"
#include "common/exclusive_port.h"
#include "common/flag_names.h"
#include "common/internal_auth.h"
#include "common/keepalive.h"
#include "common/lm_head_cpu_kernel.h"
#include "common/lm_head_precision.h"
#include "common/log_line.h"
#include "common/loopback.h"
#include "common/partition.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "common/worker_protocol.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "worker/backend_factory.h"
#include "worker/comm/control_store.h"
#include "worker/heads/frontend_lm_head_rows.h"
#include "worker/heads/lm_head_registry.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, frontend, "", "host:port of the front-end's control service (required)");
ABSL_FLAG(std::string, listen_host, "",
          "address the Worker service listens on (default: --advertise-host, else 127.0.0.1)");
ABSL_FLAG(std::string, advertise_host, "",
          "address of this machine the front-end and the other workers reach it at (Worker service and "
          "Gloo), e.g. the pod IP (default: --listen-host)");
ABSL_FLAG(bool, rejoin, true,
          "when this worker's pool generation ends or its start-up fails, re-execute and join again "
          "(false: exit)");
ABSL_FLAG(bool, exit_with_parent, false,
          "exit when the parent process exits (the front-end passes it to the workers it spawns)");
ABSL_FLAG(std::string, backend, "", "compute backend: cpu or cuda (default: as the front-end says, else cpu)");
ABSL_FLAG(std::string, comm, "",
          "communicator: gloo or nccl (nccl needs cuda; default: as the front-end says, else gloo)");
ABSL_FLAG(int, device, -1, "CUDA device of --backend cuda; -1: rank % device count");
ABSL_FLAG(int, collective_timeout, 60, "seconds before a collective or rendezvous fails");
ABSL_FLAG(std::string, lm_head_precision, "",
          "operands of the lm_head GEMM: auto, bf16, tf32 or fp32 (default: as the front-end says; when given it "
          "must equal the front-end's --lm-head-precision: every rank of a pool computes alike)");
ABSL_FLAG(std::string, fetch_lm_heads, "auto",
          "where this worker reads its lm_head slices: auto (the file the front-end names when this host can read "
          "it, else streamed from the front-end's control plane), always (always streamed: nodes that do not share "
          "the front-end's filesystem), never (only the file)");
ABSL_FLAG(std::string, internal_secret_file, "",
          "file holding the pool secret the front-end was given (--internal-secret-file): this worker's calls carry "
          "it and its Worker service takes only calls that do");
ABSL_FLAG(int, internal_secret_fd, -1,
          "descriptor holding the pool secret (the front-end passes it to the workers it spawns)");
ABSL_FLAG(bool, insecure_internal_plane, false,
          "join a front-end running --insecure-internal-plane and serve the Worker service without "
          "authentication beyond loopback");
ABSL_FLAG(int, threads, -1, "compute threads (GEMM); -1: as the front-end says, 0: library default");

using logprob::LogLine;

namespace {

int Fail(const std::string& msg) {
  LogLine() << "logprob-worker: " << msg;
  return 1;
}

/// The command line as given, for re-executing.
std::vector<std::string> g_argv;
/// --internal-secret-fd, kept open across a re-execution (-1: none).
int g_secret_fd = -1;

/// Ends this worker's membership: with `rejoin`, re-executes the binary
/// with its original arguments (same pid; a fresh process joins again),
/// else exits with `code`. The first caller wins; others block.
[[noreturn]] void EndMembership(const std::string& why, bool rejoin, int code) {
  static std::mutex once;
  once.lock();  // never unlocked
  if (!rejoin) {
    LogLine() << "logprob-worker: " << why << "; exiting";
    _exit(code);
  }
  LogLine() << "logprob-worker: " << why << "; re-executing to join again";
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(entry.path().filename().c_str());
    if (fd > 2 && fd != g_secret_fd) fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
  std::vector<char*> argv;
  for (auto& a : g_argv) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv("/proc/self/exe", argv.data());
  LogLine() << "logprob-worker: cannot re-execute " << g_argv[0] << ": " << strerror(errno);
  _exit(1);
}

/// "host:port", bracketing IPv6 addresses.
std::string HostPort(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return absl::StrCat(v6 ? "[" : "", host, v6 ? "]" : "", ":", port);
}

/// The front-end's choice for a flag the worker may also be given: an
/// explicit worker flag must agree with it. Empty on conflict (*error set).
std::string Choose(const std::string& flag, const std::string& mine, const std::string& frontend,
                   const std::string& fallback, std::string* error) {
  if (!mine.empty() && !frontend.empty() && mine != frontend) {
    *error = "--" + flag + " " + mine + " disagrees with the front-end's " + frontend;
    return "";
  }
  return !mine.empty() ? mine : !frontend.empty() ? frontend : fallback;
}

/// The worker's side of the internal plane from its flags: the secret of
/// --internal-secret-file or --internal-secret-fd; none (insecure) only on
/// loopback or with --insecure-internal-plane. INVALID_ARGUMENT otherwise.
absl::StatusOr<logprob::InternalAuth> ChooseAuth(const std::string& listen_host, const std::string& advertise_host) {
  const std::string file = absl::GetFlag(FLAGS_internal_secret_file);
  const int fd = absl::GetFlag(FLAGS_internal_secret_fd);
  const bool insecure = absl::GetFlag(FLAGS_insecure_internal_plane);
  if ((!file.empty()) + (fd >= 0) + insecure > 1)
    return absl::InvalidArgumentError(
        "--internal-secret-file, --internal-secret-fd and --insecure-internal-plane are mutually exclusive");
  if (fd >= 0) {
    absl::StatusOr<logprob::PoolSecret> secret = logprob::PoolSecret::FromFd(fd);
    if (!secret.ok()) return secret.status();
    g_secret_fd = fd;
    return logprob::InternalAuth(*secret);
  }
  if (!file.empty()) {
    absl::StatusOr<logprob::PoolSecret> secret = logprob::PoolSecret::FromFile(file);
    if (!secret.ok()) return secret.status();
    return logprob::InternalAuth(*secret);
  }
  // Where it listens counts, not only where it says it is: both must be
  // loopback to go without a secret.
  const std::string& beyond = !logprob::IsLoopbackHost(listen_host) ? listen_host : advertise_host;
  if (!insecure && !(logprob::IsLoopbackHost(listen_host) && logprob::IsLoopbackHost(advertise_host)))
    return absl::InvalidArgumentError(
        "serving the Worker service on " + beyond +
        " (beyond loopback) needs --internal-secret-file (the front-end's) so that only the pool calls it; "
        "--insecure-internal-plane serves it unauthenticated");
  LogLine() << "logprob-worker: WARNING: no pool secret: this worker's Worker service takes calls from anyone who "
               "reaches it";
  return logprob::InternalAuth::Insecure();
}

}  // namespace

int main(int argc, char** argv) {
  g_argv.assign(argv, argv + argc);
  absl::SetProgramUsageMessage(
      "logprob-worker --frontend HOST:PORT [--advertise-host ADDR] [--listen-host ADDR] [--rejoin=true|false]");
  // --version: the release and whether the build has CUDA (common/version.h).
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return logprob::VersionText("logprob-worker"); };
  absl::SetFlagsUsageConfig(usage_config);
  logprob::NormalizeFlagDashes(argc, argv);
  absl::ParseCommandLine(argc, argv);
  // A locally spawned worker dies with its front-end.
  if (absl::GetFlag(FLAGS_exit_with_parent)) prctl(PR_SET_PDEATHSIG, SIGTERM);
  // Exit promptly on SIGTERM, also as a container's pid 1.
  std::signal(SIGTERM, [](int) { _exit(0); });
  const std::string frontend = absl::GetFlag(FLAGS_frontend);
  if (frontend.empty()) return Fail("--frontend is required");
  if (!absl::GetFlag(FLAGS_backend).empty() || !absl::GetFlag(FLAGS_comm).empty()) {
    const std::string b = absl::GetFlag(FLAGS_backend).empty() ? "cpu" : absl::GetFlag(FLAGS_backend);
    if (auto st =
            logprob::CheckBackendChoice(b, absl::GetFlag(FLAGS_comm).empty() ? "gloo" : absl::GetFlag(FLAGS_comm));
        !st.ok())
      return Fail(std::string(st.message()));
  }
  const auto fetch_mode = logprob::ParseLmHeadFetchMode(absl::GetFlag(FLAGS_fetch_lm_heads));
  if (!fetch_mode.ok()) return Fail(std::string(fetch_mode.status().message()));
  if (const std::string p = absl::GetFlag(FLAGS_lm_head_precision); !p.empty())
    if (auto parsed = logprob::ParseLmHeadPrecision(p); !parsed.ok())
      return Fail(std::string(parsed.status().message()));
  std::string listen_host = absl::GetFlag(FLAGS_listen_host), advertise_host = absl::GetFlag(FLAGS_advertise_host);
  if (listen_host.empty()) listen_host = advertise_host.empty() ? "127.0.0.1" : advertise_host;
  if (advertise_host.empty()) advertise_host = listen_host;
  if (advertise_host == "0.0.0.0" || advertise_host == "::" || advertise_host == "[::]")
    return Fail(
        "--advertise-host must be an address of this machine that the front-end and the other workers "
        "reach (e.g. the pod IP), not the wildcard " +
        advertise_host + " (with --listen-host " + listen_host + ", set --advertise-host)");
  const bool rejoin = absl::GetFlag(FLAGS_rejoin);
  // The pool secret: every call this worker makes carries it, and its
  // Worker service takes only calls that do.
  const absl::StatusOr<logprob::InternalAuth> auth = ChooseAuth(listen_host, advertise_host);
  if (!auth.ok()) return Fail(std::string(auth.status().message()));

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  // Keepalive on the Join stream: a front-end host that vanishes, or this
  // host's link, is noticed within seconds (common/keepalive.h).
  logprob::SetKeepalive(args);
  // A front-end that restarts is found again within seconds, not gRPC's default 2 minutes.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  auto channel = auth->Channel(frontend, args);
  auto control =
      std::shared_ptr<logprob::internal::v1::Control::Stub>(logprob::internal::v1::Control::NewStub(channel));

  // Join, then wait in the stream for the rank (given once the pool has
  // all its workers). With --rejoin a refused or failed join is retried.
  logprob::internal::v1::JoinRequest join;
  join.set_pid(getpid());
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  join.set_hostname(host);
  join.set_protocol_version(logprob::kWorkerProtocolVersion);
  join.set_build(logprob::BuildId());
  logprob::internal::v1::JoinReply joined;
  std::unique_ptr<grpc::ClientContext> membership_ctx;  // lives as long as the membership
  std::unique_ptr<grpc::ClientReader<logprob::internal::v1::JoinReply>> membership;
  LogLine() << "logprob-worker: joining " << frontend;
  while (true) {
    membership.reset();
    membership_ctx = std::make_unique<grpc::ClientContext>();
    membership_ctx->set_wait_for_ready(rejoin);  // with --rejoin, wait for a front-end that is not up yet
    membership = control->Join(membership_ctx.get(), join);
    if (membership->Read(&joined)) break;
    const grpc::Status st = membership->Finish();
    // Refused for good (a front-end of another release, or one that wants a
    // pool secret this worker does not have): retrying cannot help.
    if (st.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
        st.error_code() == grpc::StatusCode::UNAUTHENTICATED)
      return Fail("join " + frontend + " refused: " + st.error_message());
    if (!rejoin) return Fail("join " + frontend + ": " + st.error_message());
    LogLine() << "logprob-worker: join " << frontend << ": " << st.error_message() << "; trying again in 2 s";
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  // A front-end of an older release accepts the join without checking.
  if (joined.protocol_version() != logprob::kWorkerProtocolVersion)
    EndMembership("cannot join " + frontend + ": " +
                      logprob::ProtocolMismatch(logprob::kWorkerProtocolVersion, joined.protocol_version()),
                  false, 1);
  if (joined.build() != logprob::BuildId())
    EndMembership("cannot join " + frontend + ": " + logprob::BuildMismatch(logprob::BuildId(), joined.build()), false,
                  1);
  const int rank = joined.rank(), world = joined.world_size();
  LogLine() << "logprob-worker: rank " << rank << "/" << world << " of pool generation " << joined.generation();
  // The membership ends when the stream does: the front-end reset the pool
  // (a peer failed), stops, or is gone.
  std::thread([&membership, rejoin] {
    logprob::internal::v1::JoinReply more;
    while (membership->Read(&more)) {
    }
    const grpc::Status st = membership->Finish();
    EndMembership("the front-end ended this worker's pool membership: " + st.error_message(), rejoin, 0);
  }).detach();
  // A start-up step failing (a peer gone during the rendezvous, the
  // generation reset before Ready) is transient: join again.
  auto startup_failed = [rejoin](const std::string& why) {
    if (rejoin) std::this_thread::sleep_for(std::chrono::seconds(1));
    EndMembership(why, rejoin, 1);
  };

  // Configuration errors (a backend choice that disagrees with the
  // front-end's, a missing lm_head, no usable GPU): exit.
  std::string choice_error;
  const std::string backend_name =
      Choose("backend", absl::GetFlag(FLAGS_backend), joined.backend(), "cpu", &choice_error);
  const std::string comm_name = Choose("comm", absl::GetFlag(FLAGS_comm), joined.comm(), "gloo", &choice_error);
  const std::string precision_name = Choose("lm-head-precision", absl::GetFlag(FLAGS_lm_head_precision),
                                            joined.lm_head_precision(), "auto", &choice_error);
  if (!choice_error.empty()) EndMembership(choice_error, false, 1);
  const auto precision = logprob::ParseLmHeadPrecision(precision_name);
  if (!precision.ok()) EndMembership("front-end: " + std::string(precision.status().message()), false, 1);
  if (auto st = logprob::CheckBackendChoice(backend_name, comm_name); !st.ok())
    EndMembership(std::string(st.message()), false, 1);
  logprob::BackendConfig backend_config;
  backend_config.backend = backend_name;
  backend_config.rank = rank;
  backend_config.device = absl::GetFlag(FLAGS_device);
  backend_config.threads = absl::GetFlag(FLAGS_threads) >= 0 ? absl::GetFlag(FLAGS_threads) : joined.threads();
  // The pool's bf16 GEMM kernel, the same on every rank (empty: a cuda pool).
  if (!joined.lm_head_cpu_kernel().empty()) {
    const auto kernel = logprob::ParseLmHeadCpuKernel(joined.lm_head_cpu_kernel(), "JoinReply.lm_head_cpu_kernel");
    if (!kernel.ok()) EndMembership("front-end: " + std::string(kernel.status().message()), false, 1);
    backend_config.lm_head_cpu_kernel = *kernel;
  }
  auto backend = logprob::MakeBackend(backend_config);
  if (!backend.ok())
    EndMembership("--backend " + backend_name + ": " + std::string(backend.status().message()), false, 1);
  // Every lm_head version the front-end serves (or still has requests for).
  // A slice this host cannot read comes from the front-end (--fetch-lm-heads).
  auto lm_heads = std::make_unique<logprob::LmHeadRegistry>(
      **backend, *precision, rank, world,
      logprob::FrontendLmHeadRows(control, joined.generation(), std::chrono::minutes(10)), *fetch_mode,
      logprob::LmHeadFileRule::Of(joined));
  for (const auto& load : joined.lm_heads())
    if (auto loaded = lm_heads->Load(load); !loaded.ok())
      EndMembership("lm_head " + load.head().name() + " version " + load.head().version() + ": " +
                        std::string(loaded.status().message()),
                    false, 1);
  logprob::ControlStore store(control, joined.store_prefix());
  auto comm = logprob::MakeCommunicator(comm_name, **backend, store, advertise_host, rank, world,
                                        std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout)));
  if (!comm.ok()) startup_failed("--comm " + comm_name + ": " + std::string(comm.status().message()));
  LogLine() << "logprob-worker: rank " << rank << " backend " << backend_name << ", comm " << comm_name
            << ", lm_head precision " << precision_name << ", lm_head CPU kernel "
            << (joined.lm_head_cpu_kernel().empty() ? std::string("none") : joined.lm_head_cpu_kernel())
            << ", lm_head store "
            << (joined.lm_head_store_dir().empty() ? std::string("none") : joined.lm_head_store_dir());

  logprob::WorkerService service(
      std::move(*comm), std::move(*backend), std::move(lm_heads), joined.hidden_chunk_tokens(),
      {*auth, joined.generation(), joined.payload_region_prefix(), joined.lm_head_store_dir(),
       logprob::HeadGradientSteps::Options{joined.gradient_step_bytes(),
                                           joined.gradient_step_timeout_seconds() > 0
                                               ? absl::Seconds(joined.gradient_step_timeout_seconds())
                                               : absl::Minutes(10)}});
  grpc::ServerBuilder builder;
  int port = 0;
  logprob::ExclusivePorts(builder);
  logprob::SetKeepalive(builder);  // accepts the front-end's pings; pings it back
  builder.AddListeningPort(HostPort(listen_host, 0), grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server || port == 0) EndMembership("cannot start the Worker service on " + listen_host, false, 1);

  logprob::internal::v1::ReadyRequest ready;
  ready.set_rank(rank);
  ready.set_worker_address(HostPort(advertise_host, port));
  ready.set_store_prefix(joined.store_prefix());
  logprob::internal::v1::ReadyReply ready_reply;
  // Logged before Ready: once the front-end has every Ready it reports
  // SERVING, and a line written after that could be lost if it then stops.
  LogLine() << "logprob-worker: rank " << rank << "/" << world << " serving on " << ready.worker_address();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto st = control->Ready(&ctx, ready, &ready_reply);
    if (!st.ok()) startup_failed("ready: " + st.error_message());
  }
  server->Wait();
  return 0;
}
