// logprob-worker: one scoring worker process (CPU backend, Gloo).
//
// Joins the front-end's control plane (--frontend), forms the Gloo
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

namespace {

int Fail(const std::string& msg) {
  std::cerr << "logprob-worker: " << msg << std::endl;
  return 1;
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
  logprob::ControlStore store(control, joined.store_prefix());
  auto comm = logprob::GlooCommunicator::Create(store, absl::GetFlag(FLAGS_listen_host), rank, world,
                                                std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout)));
  if (!comm.ok()) return Fail(std::string(comm.status().message()));

  logprob::WorkerService service(std::move(*comm));
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
