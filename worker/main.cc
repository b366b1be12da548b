// logprob-worker: one scoring worker process (CPU backend, Gloo).
//
// Joins the front-end's control plane (--frontend), loads its vocabulary
// slice of the lm_head when the front-end has one, forms the Gloo
// communicator through the front-end's store, serves the internal Worker
// service and reports Ready with its address.
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
#include "worker/control_store.h"
#include "worker/gloo_communicator.h"
#include "worker/worker_service.h"

ABSL_FLAG(std::string, frontend, "", "host:port of the front-end's control service (required)");
ABSL_FLAG(std::string, listen_host, "127.0.0.1", "address the Worker service and Gloo listen on");
ABSL_FLAG(std::string, backend, "cpu", "compute backend: cpu");
ABSL_FLAG(std::string, comm, "gloo", "communicator: gloo");
ABSL_FLAG(int, collective_timeout, 60, "seconds before a collective or rendezvous fails");
ABSL_FLAG(int, threads, -1, "compute threads (GEMM); -1: as the front-end says, 0: library default");

namespace {

int Fail(const std::string& msg) {
  std::cerr << "logprob-worker: " << msg << std::endl;
  return 1;
}

/// Reads this rank's vocabulary slice of the lm_head named in the join
/// reply and builds its GEMM; null when the front-end has no lm_head.
absl::StatusOr<std::unique_ptr<logprob::kernels::LmHeadGemm>> LoadLmHeadSlice(
    const logprob::internal::v1::JoinReply& joined, int threads) {
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
  std::vector<char> weight(static_cast<size_t>((ve - vb) * source.hidden_size) * logprob::DTypeSize(source.dtype));
  if (auto st = logprob::ReadLmHeadRows(source, vb, ve, weight.data()); !st.ok()) return st;
  auto gemm = logprob::kernels::LmHeadGemm::Create(source.dtype, std::move(weight), ve - vb, source.hidden_size, threads);
  if (!gemm.ok()) return gemm.status();
  std::cerr << "logprob-worker: rank " << joined.rank() << " loaded " << source.tensor << " rows [" << vb << ", " << ve
            << ") x " << source.hidden_size << " " << logprob::DTypeName(source.dtype) << " from " << source.file
            << " (" << ((*gemm)->weight_bytes() >> 20) << " MiB as " << logprob::DTypeName((*gemm)->compute_dtype())
            << ") in " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s"
            << std::endl;
  return gemm;
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
  if (absl::GetFlag(FLAGS_backend) != "cpu") return Fail("--backend " + absl::GetFlag(FLAGS_backend) + " is not built in this binary (cpu is)");
  if (absl::GetFlag(FLAGS_comm) != "gloo") return Fail("--comm " + absl::GetFlag(FLAGS_comm) + " is not supported (gloo is)");

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
  const int threads = absl::GetFlag(FLAGS_threads) >= 0 ? absl::GetFlag(FLAGS_threads) : joined.threads();
  auto lm_head = LoadLmHeadSlice(joined, threads);
  if (!lm_head.ok()) return Fail("lm_head: " + std::string(lm_head.status().message()));
  logprob::ControlStore store(control, joined.store_prefix());
  auto comm = logprob::GlooCommunicator::Create(store, absl::GetFlag(FLAGS_listen_host), rank, world,
                                                std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout)));
  if (!comm.ok()) return Fail(std::string(comm.status().message()));

  logprob::WorkerService service(std::move(*comm), std::move(*lm_head), joined.hidden_chunk_tokens());
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
