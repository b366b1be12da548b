#include "server/worker_pool.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <future>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

extern char** environ;

namespace logprob {

WorkerPool::WorkerPool(Options options) : options_(std::move(options)) {}

WorkerPool::~WorkerPool() {
  for (pid_t pid : pids_) kill(pid, SIGTERM);
  for (pid_t pid : pids_) waitpid(pid, nullptr, 0);
  if (control_server_) control_server_->Shutdown(std::chrono::system_clock::now());
}

absl::Status WorkerPool::Start() {
  control_ = std::make_unique<ControlService>(options_.workers, "gen0/", options_.worker_config);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options_.control_listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(control_.get());
  control_server_ = builder.BuildAndStart();
  if (!control_server_ || port == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on control address ", options_.control_listen));
  const std::string host = options_.control_listen.substr(0, options_.control_listen.rfind(':'));
  const std::string frontend = absl::StrCat(host, ":", port);

  for (int w = 0; w < options_.workers; ++w) {
    std::vector<std::string> args = {options_.worker_binary, "--frontend=" + frontend};
    args.insert(args.end(), options_.worker_args.begin(), options_.worker_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (int err = posix_spawn(&pid, options_.worker_binary.c_str(), nullptr, nullptr, argv.data(), environ); err != 0)
      return absl::UnavailableError(absl::StrCat("cannot start worker ", options_.worker_binary, ": ", strerror(err)));
    pids_.push_back(pid);
  }

  // Wait for all to be ready, noticing a worker that exits early.
  const auto deadline = std::chrono::steady_clock::now() + options_.join_timeout;
  absl::StatusOr<std::vector<std::string>> addresses;
  while (true) {
    addresses = control_->WaitAllReady(std::chrono::milliseconds(100));
    if (addresses.ok()) break;
    for (pid_t pid : pids_) {
      int status;
      if (waitpid(pid, &status, WNOHANG) == pid)
        return absl::UnavailableError(absl::StrCat("worker process ", pid, " exited during start-up (status ", status, ")"));
    }
    if (std::chrono::steady_clock::now() > deadline) return addresses.status();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  for (const auto& addr : *addresses)
    stubs_.push_back(internal::v1::Worker::NewStub(grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args)));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<internal::v1::WorkResult>> WorkerPool::Run(const Plan& plan) {
  std::unique_lock<std::mutex> collective;
  if (plan.layout != internal::v1::TOKEN_PARALLEL) collective = std::unique_lock<std::mutex>(collective_mu_);
  std::vector<internal::v1::WorkResult> results(plan.items.size());
  std::vector<grpc::Status> statuses(plan.items.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    threads.emplace_back([&, i] {
      const PlannedItem& p = plan.items[i];
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + options_.work_timeout);
      statuses[i] = stubs_[p.worker]->Run(&ctx, p.item, &results[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok())
      return absl::Status(static_cast<absl::StatusCode>(statuses[i].error_code()),
                          absl::StrCat("worker ", plan.items[i].worker, ": ", statuses[i].error_message()));
  }
  return results;
}

}  // namespace logprob
