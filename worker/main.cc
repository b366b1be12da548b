// logprob-worker: one scoring worker process (CPU or CUDA backend, Gloo
// or NCCL communicator).
//
// Joins the front-end's control plane (--frontend), loads its vocabulary
// slice of the lm_head when the front-end has one (uploaded once to the
// GPU with --backend cuda), forms the communicator through the front-end's
// store (Gloo rendezvous, or rank 0's NCCL unique id), serves the internal
// Worker service and reports Ready with its address.
#include <grpcpp/grpcpp.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/flag_names.h"
#include "common/lm_head_source.h"
#include "common/partition.h"
#include "absl/strings/str_cat.h"
#include "logprob/internal/v1/worker.grpc.pb.h"
#include "common/backend_choice.h"
#include "worker/backend_factory.h"
#include "worker/control_store.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, frontend, "", "host:port of the front-end's control service (required)");
ABSL_FLAG(std::string, listen_host, "127.0.0.1", "address the Worker service and Gloo listen on");
ABSL_FLAG(std::string, backend, "", "compute backend: cpu or cuda (default: as the front-end says, else cpu)");
ABSL_FLAG(std::string, comm, "", "communicator: gloo or nccl (nccl needs cuda; default: as the front-end says, else gloo)");
ABSL_FLAG(int, device, -1, "CUDA device of --backend cuda; -1: rank % device count");
ABSL_FLAG(int, collective_timeout, 60, "seconds before a collective or rendezvous fails");
ABSL_FLAG(int, threads, -1, "compute threads (GEMM); -1: as the front-end says, 0: library default");

namespace {

int Fail(const std::string& msg) {
  std::cerr << "logprob-worker: " << msg << std::endl;
  return 1;
}

/// Reads this rank's vocabulary slice of the lm_head named in the join
/// reply; null when the front-end has no lm_head.
absl::StatusOr<std::unique_ptr<logprob::LmHeadSlice>> ReadLmHeadSlice(const logprob::internal::v1::JoinReply& joined) {
  const auto& src = joined.lm_head();
  if (src.file().empty()) return nullptr;
  logprob::LmHeadSource source;
  source.file = src.file();
  source.tensor = src.tensor();
  source.dtype = src.dtype();
  source.vocab_size = src.vocab_size();
  source.hidden_size = src.hidden_size();
  source.data_offset = src.data_offset();
  const auto [vb, ve] = logprob::SplitRange(source.vocab_size, joined.world_size(), joined.rank());
  const auto t0 = std::chrono::steady_clock::now();
  auto slice = std::make_unique<logprob::LmHeadSlice>();
  slice->dtype = source.dtype;
  slice->rows = ve - vb;
  slice->hidden_size = source.hidden_size;
  slice->weight.resize(static_cast<size_t>((ve - vb) * source.hidden_size) * logprob::DTypeSize(source.dtype));
  if (auto st = logprob::ReadLmHeadRows(source, vb, ve, slice->weight.data()); !st.ok()) return st;
  std::cerr << "logprob-worker: rank " << joined.rank() << " read " << source.tensor << " rows [" << vb << ", " << ve
            << ") x " << source.hidden_size << " " << logprob::DTypeName(source.dtype) << " from " << source.file
            << " (" << (slice->weight.size() >> 20) << " MiB) in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s" << std::endl;
  return slice;
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

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("logprob-worker --frontend HOST:PORT [--listen_host ADDR]");
  logprob::NormalizeFlagDashes(argc, argv);
  absl::ParseCommandLine(argc, argv);
  // A locally spawned worker dies with its front-end.
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  const std::string frontend = absl::GetFlag(FLAGS_frontend);
  if (frontend.empty()) return Fail("--frontend is required");
  if (!absl::GetFlag(FLAGS_backend).empty() || !absl::GetFlag(FLAGS_comm).empty()) {
    const std::string b = absl::GetFlag(FLAGS_backend).empty() ? "cpu" : absl::GetFlag(FLAGS_backend);
    if (auto st = logprob::CheckBackendChoice(b, absl::GetFlag(FLAGS_comm).empty() ? "gloo" : absl::GetFlag(FLAGS_comm));
        !st.ok())
      return Fail(std::string(st.message()));
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(frontend, grpc::InsecureChannelCredentials(), args);
  auto control = std::shared_ptr<logprob::internal::v1::Control::Stub>(logprob::internal::v1::Control::NewStub(channel));

  logprob::internal::v1::JoinRequest join;
  join.set_pid(getpid());
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  join.set_hostname(host);
  logprob::internal::v1::JoinReply joined;
  {
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto st = control->Join(&ctx, join, &joined);
    if (!st.ok()) return Fail("join " + frontend + ": " + st.error_message());
  }
  const int rank = joined.rank(), world = joined.world_size();
  std::string choice_error;
  const std::string backend_name = Choose("backend", absl::GetFlag(FLAGS_backend), joined.backend(), "cpu", &choice_error);
  const std::string comm_name = Choose("comm", absl::GetFlag(FLAGS_comm), joined.comm(), "gloo", &choice_error);
  if (!choice_error.empty()) return Fail(choice_error);
  if (auto st = logprob::CheckBackendChoice(backend_name, comm_name); !st.ok()) return Fail(std::string(st.message()));
  auto lm_head = ReadLmHeadSlice(joined);
  if (!lm_head.ok()) return Fail("lm_head: " + std::string(lm_head.status().message()));
  logprob::BackendConfig backend_config;
  backend_config.backend = backend_name;
  backend_config.rank = rank;
  backend_config.device = absl::GetFlag(FLAGS_device);
  backend_config.threads = absl::GetFlag(FLAGS_threads) >= 0 ? absl::GetFlag(FLAGS_threads) : joined.threads();
  backend_config.lm_head = lm_head->get();
  auto backend = logprob::MakeBackend(backend_config);
  if (!backend.ok()) return Fail("--backend " + backend_name + ": " + std::string(backend.status().message()));
  lm_head->reset();  // the backend holds (or has uploaded) the weights
  logprob::ControlStore store(control, joined.store_prefix());
  auto comm = logprob::MakeCommunicator(comm_name, **backend, store, absl::GetFlag(FLAGS_listen_host), rank, world,
                                        std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout)));
  if (!comm.ok()) return Fail("--comm " + comm_name + ": " + std::string(comm.status().message()));
  std::cerr << "logprob-worker: rank " << rank << " backend " << backend_name << ", comm " << comm_name << std::endl;

  logprob::WorkerService service(std::move(*comm), std::move(*backend), joined.hidden_chunk_tokens());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrCat(absl::GetFlag(FLAGS_listen_host), ":0"), grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server || port == 0) return Fail("cannot start the Worker service");

  logprob::internal::v1::ReadyRequest ready;
  ready.set_rank(rank);
  ready.set_worker_address(absl::StrCat(absl::GetFlag(FLAGS_listen_host), ":", port));
  ready.set_store_prefix(joined.store_prefix());
  logprob::internal::v1::ReadyReply ready_reply;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto st = control->Ready(&ctx, ready, &ready_reply);
    if (!st.ok()) return Fail("ready: " + st.error_message());
  }
  std::cerr << "logprob-worker: rank " << rank << "/" << world << " serving on " << ready.worker_address() << std::endl;
  server->Wait();
  return 0;
}
