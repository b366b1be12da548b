#include "server/worker_pool.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

extern char** environ;

namespace logprob {
namespace {

/// "exited with status 3" / "was killed by signal 9".
std::string DescribeExit(int status) {
  if (WIFSIGNALED(status)) return absl::StrCat("was killed by signal ", WTERMSIG(status));
  return absl::StrCat("exited with status ", WEXITSTATUS(status));
}

}  // namespace

WorkerPool::WorkerPool(Options options) : options_(std::move(options)) {}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (supervisor_.joinable()) supervisor_.join();
  if (gen_) Kill(*gen_);
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
  frontend_ = absl::StrCat(host, ":", port);

  auto gen = std::make_shared<Generation>();
  if (auto st = Spawn(*gen); !st.ok()) {
    Kill(*gen);
    return st;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    gen_ = gen;
  }
  serving_ = true;
  if (options_.on_serving) options_.on_serving(true);
  supervisor_ = std::thread([this] { Supervise(); });
  return absl::OkStatus();
}

absl::Status WorkerPool::Spawn(Generation& gen) {
  for (int w = 0; w < options_.workers; ++w) {
    std::vector<std::string> args = {options_.worker_binary, "--frontend=" + frontend_};
    args.insert(args.end(), options_.worker_args.begin(), options_.worker_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (int err = posix_spawn(&pid, options_.worker_binary.c_str(), nullptr, nullptr, argv.data(), environ); err != 0)
      return absl::UnavailableError(absl::StrCat("cannot start worker ", options_.worker_binary, ": ", strerror(err)));
    gen.pids.push_back(pid);
  }
  // Wait for all to be ready, noticing a worker that exits early.
  const auto deadline = std::chrono::steady_clock::now() + options_.join_timeout;
  absl::StatusOr<std::vector<std::string>> addresses;
  while (true) {
    addresses = control_->WaitAllReady(std::chrono::milliseconds(100));
    if (addresses.ok()) break;
    for (pid_t& pid : gen.pids) {
      int status;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        const std::string why = DescribeExit(status);
        pid = -1;  // reaped
        return absl::UnavailableError(absl::StrCat("worker process ", why, " during start-up"));
      }
    }
    if (std::chrono::steady_clock::now() > deadline) return addresses.status();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  for (const auto& addr : *addresses)
    gen.stubs.push_back(
        internal::v1::Worker::NewStub(grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args)));
  return absl::OkStatus();
}

void WorkerPool::Kill(Generation& gen) {
  for (pid_t pid : gen.pids)
    if (pid > 0) kill(pid, SIGKILL);
  for (pid_t& pid : gen.pids)
    if (pid > 0) waitpid(pid, nullptr, 0), pid = -1;
}

std::shared_ptr<WorkerPool::Generation> WorkerPool::current() {
  std::lock_guard<std::mutex> lock(mu_);
  return gen_;
}

void WorkerPool::Fail(const std::shared_ptr<Generation>& gen, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(gen->mu);
    if (gen->failed) return;
    gen->failed = true;
    gen->failure = why;
    for (grpc::ClientContext* ctx : gen->inflight) ctx->TryCancel();
  }
  if (gen == current()) {
    serving_ = false;
    if (options_.on_serving) options_.on_serving(false);
  }
  std::cerr << "logprob-server: worker pool generation " << gen->index << " failed: " << why
            << "; re-forming the pool" << std::endl;
  cv_.notify_all();
}

void WorkerPool::Supervise() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(50));
    if (stop_) break;
    std::shared_ptr<Generation> gen = gen_;
    lock.unlock();
    for (size_t r = 0; r < gen->pids.size(); ++r) {
      int status;
      if (gen->pids[r] > 0 && waitpid(gen->pids[r], &status, WNOHANG) == gen->pids[r]) {
        const pid_t pid = gen->pids[r];
        gen->pids[r] = -1;
        Fail(gen, absl::StrCat("worker rank ", r, " (pid ", pid, ") ", DescribeExit(status)));
      }
    }
    bool failed;
    {
      std::lock_guard<std::mutex> g(gen->mu);
      failed = gen->failed;
    }
    if (failed) {
      // Re-form: kill the rest, reset the control plane, spawn a new generation.
      Kill(*gen);
      auto next = std::make_shared<Generation>();
      next->index = gen->index + 1;
      control_->Reset(absl::StrCat("gen", next->index, "/"));
      if (auto st = Spawn(*next); !st.ok()) {
        std::cerr << "logprob-server: re-forming the worker pool failed: " << st.message() << "; retrying"
                  << std::endl;
        Kill(*next);
        std::this_thread::sleep_for(std::chrono::seconds(1));
        lock.lock();
        continue;  // gen_ stays the failed generation: the next round retries
      }
      lock.lock();
      gen_ = next;
      lock.unlock();
      ++restarts_;
      serving_ = true;
      std::cerr << "logprob-server: worker pool generation " << next->index << " ready (" << options_.workers
                << " workers)" << std::endl;
      if (options_.on_restart) options_.on_restart();
      if (options_.on_serving) options_.on_serving(true);
    }
    lock.lock();
  }
}

absl::StatusOr<std::vector<internal::v1::WorkResult>> WorkerPool::Run(const Plan& plan, const RunBounds& bounds) {
  std::unique_lock<std::mutex> collective;
  if (plan.layout != internal::v1::TOKEN_PARALLEL) collective = std::unique_lock<std::mutex>(collective_mu_);
  const std::shared_ptr<Generation> gen = current();
  const size_t n = plan.items.size();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(n);
  auto deadline = std::chrono::system_clock::now() + options_.work_timeout;
  if (bounds.deadline < deadline) deadline = bounds.deadline;
  {
    std::lock_guard<std::mutex> lock(gen->mu);
    if (!serving_ || gen->failed)
      return absl::UnavailableError("the worker pool is re-forming after a worker failure; retry shortly");
    for (auto& ctx : contexts) {
      ctx = std::make_unique<grpc::ClientContext>();
      ctx->set_deadline(deadline);
      gen->inflight.insert(ctx.get());
    }
  }
  std::vector<internal::v1::WorkResult> results(n);
  std::vector<grpc::Status> statuses(n);
  std::mutex done_mu;
  std::condition_variable done_cv;
  size_t done = 0;
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      const PlannedItem& p = plan.items[i];
      statuses[i] = gen->stubs[p.worker]->Run(contexts[i].get(), p.item, &results[i]);
      std::lock_guard<std::mutex> lock(done_mu);
      ++done;
      done_cv.notify_all();
    });
  }
  // Wait, cancelling the worker calls if the client goes away.
  bool cancelled = false;
  {
    std::unique_lock<std::mutex> lock(done_mu);
    while (!done_cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return done == n; })) {
      if (!cancelled && bounds.cancelled && bounds.cancelled()) {
        cancelled = true;
        for (auto& ctx : contexts) ctx->TryCancel();
      }
    }
  }
  for (auto& t : threads) t.join();
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(gen->mu);
    for (auto& ctx : contexts) gen->inflight.erase(ctx.get());
    failure = gen->failed ? gen->failure : "";
  }
  const bool client_expired = bounds.expired();
  if (!failure.empty())
    return absl::UnavailableError(absl::StrCat("worker pool failed (", failure, "); it is being re-formed, retry"));
  if (client_expired) {
    for (const auto& st : statuses)
      if (!st.ok()) return absl::DeadlineExceededError("the request's deadline passed before the workers finished");
  }
  if (cancelled || (bounds.cancelled && bounds.cancelled()))
    return absl::CancelledError("the request was cancelled by the client");
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i].ok()) continue;
    const std::string msg = absl::StrCat("worker ", plan.items[i].worker, ": ", statuses[i].error_message());
    const auto code = statuses[i].error_code();
    if (code == grpc::StatusCode::DEADLINE_EXCEEDED && client_expired)
      return absl::DeadlineExceededError("the request's deadline passed before the workers finished");
    if (code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
        code == grpc::StatusCode::CANCELLED) {
      // A worker that is gone, hung past work_timeout, or lost a collective peer.
      Fail(gen, msg);
      return absl::UnavailableError(absl::StrCat("worker pool failed (", msg, "); it is being re-formed, retry"));
    }
    return absl::Status(static_cast<absl::StatusCode>(code), msg);
  }
  return results;
}

}  // namespace logprob
