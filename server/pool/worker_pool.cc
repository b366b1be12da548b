#include "server/pool/worker_pool.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <iostream>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/exclusive_port.h"
#include "common/grpc_status.h"
#include "common/keepalive.h"
#include "common/log_line.h"
#include "common/status_macros.h"
#include "common/worker_protocol.h"

namespace logprob {

WorkerPool::WorkerPool(Options options, std::unique_ptr<WorkerLauncher> launcher)
    : options_(std::move(options)), launcher_(std::move(launcher)) {}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  if (supervisor_.joinable()) supervisor_.join();
  launcher_->Stop();
  if (control_) control_->Shutdown();
  if (control_server_) control_server_->Shutdown(std::chrono::system_clock::now());
}

absl::Status WorkerPool::Start() {
  control_ = std::make_unique<ControlService>(
      options_.workers, options_.worker_config,
      [this](int64_t generation, int, const std::string& why) { OnLeave(generation, why); }, options_.join_observers,
      kWorkerProtocolVersion, options_.auth);
  if (options_.lm_heads)
    control_->SetReplyHook([this](internal::v1::JoinReply* reply) {
      for (auto& load : options_.lm_heads()) *reply->add_lm_heads() = std::move(load);
    });
  control_->SetLmHeadFiles(options_.lm_head_files);
  grpc::ServerBuilder builder;
  // Keepalive on the Join streams: a worker host that vanishes without
  // closing its connection (power, network) is noticed within seconds.
  SetKeepalive(builder);
  ExclusivePorts(builder);
  int port = 0;
  builder.AddListeningPort(options_.control_listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(control_.get());
  control_server_ = builder.BuildAndStart();
  if (!control_server_ || port == 0)
    return absl::UnavailableError(
        absl::StrCat("cannot listen on --control-listen ", ListenFailure(options_.control_listen)));
  const std::string host = options_.control_listen.substr(0, options_.control_listen.rfind(':'));
  frontend_ = absl::StrCat(host, ":", port);
  LogLine() << "logprob-server: control plane on " << frontend_ << "; the pool " << launcher_->Describe();

  if (!launcher_->waits_for_workers()) {
    if (auto st = Form(0); !st.ok()) {
      launcher_->Stop();
      return st;
    }
  }
  supervisor_ = std::thread([this] { Supervise(); });
  return absl::OkStatus();
}

absl::Status WorkerPool::Form(int64_t index) {
  if (draining()) return absl::CancelledError("the server is draining: no worker pool is formed");
  auto gen = std::make_shared<Generation>();
  gen->index = index;
  control_->Reset(index);  // ends the previous generation's Join streams
  {
    absl::MutexLock lock(&mu_);
    gen_ = gen;
  }
  LogLine() << "logprob-server: forming worker pool generation " << index;
  LOGPROB_RETURN_IF_ERROR(launcher_->Launch(index, frontend_));
  // Wait for all to be ready, noticing a worker that exits or leaves early.
  using Clock = std::chrono::steady_clock;
  auto deadline = launcher_->waits_for_workers() ? Clock::time_point::max() : Clock::now() + options_.join_timeout;
  absl::StatusOr<std::vector<std::string>> addresses;
  while (true) {
    addresses = control_->WaitAllReady(std::chrono::milliseconds(100));
    if (addresses.ok()) break;
    if (stopping()) return absl::CancelledError("the worker pool is stopping");
    if (draining()) return absl::CancelledError("the server is draining: the worker pool is not formed");
    {
      absl::MutexLock lock(&gen->mu);
      if (gen->failed) return absl::UnavailableError(gen->failure);
    }
    if (auto why = launcher_->Poll()) return absl::UnavailableError(absl::StrCat(*why, " during start-up"));
    if (deadline == Clock::time_point::max() && control_->all_joined()) deadline = Clock::now() + options_.join_timeout;
    if (Clock::now() > deadline) return addresses.status();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  SetKeepalive(args);  // a call to a worker whose host is gone fails within seconds
  for (const auto& addr : *addresses)
    gen->stubs.push_back(internal::v1::Worker::NewStub(options_.auth.Channel(addr, args)));
  {
    absl::MutexLock lock(&gen->mu);
    if (gen->failed) return absl::UnavailableError(gen->failure);
    gen->ready = true;
  }
  LogLine() << "logprob-server: worker pool generation " << index << " ready (" << options_.workers << " workers)";
  Publish();
  return absl::OkStatus();
}

std::shared_ptr<WorkerPool::Generation> WorkerPool::current() {
  absl::MutexLock lock(&mu_);
  return gen_;
}

absl::StatusOr<int64_t> WorkerPool::OnEveryWorker(
    const std::function<grpc::Status(internal::v1::Worker::Stub&, grpc::ClientContext*)>& call,
    std::chrono::milliseconds timeout) {
  return OnWorkers(0, SIZE_MAX, call, timeout);
}

absl::StatusOr<int64_t> WorkerPool::OnWorker(
    size_t rank, const std::function<grpc::Status(internal::v1::Worker::Stub&, grpc::ClientContext*)>& call,
    std::chrono::milliseconds timeout) {
  return OnWorkers(rank, rank + 1, call, timeout);
}

absl::StatusOr<int64_t> WorkerPool::OnWorkers(
    size_t first, size_t last,
    const std::function<grpc::Status(internal::v1::Worker::Stub&, grpc::ClientContext*)>& call,
    std::chrono::milliseconds timeout) {
  const std::shared_ptr<Generation> gen = current();
  if (!gen) return absl::UnavailableError("the worker pool is waiting for its workers to join; retry shortly");
  {
    absl::MutexLock lock(&gen->mu);
    if (gen->failed || !gen->ready)
      return absl::UnavailableError("the worker pool is not serving (re-forming or waiting for workers); retry");
  }
  const size_t n = std::min(last, gen->stubs.size());
  std::vector<grpc::Status> statuses(n);
  std::vector<v1::ErrorReason> reasons(n, v1::ERROR_REASON_UNSPECIFIED);
  std::vector<std::thread> threads;
  for (size_t i = first; i < n; ++i)
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + timeout);
      statuses[i] = call(*gen->stubs[i], &ctx);
      if (!statuses[i].ok()) reasons[i] = SentReason(ctx);
    });
  for (auto& t : threads) t.join();
  for (size_t i = first; i < n; ++i)
    if (!statuses[i].ok())
      return WithReason(absl::Status(static_cast<absl::StatusCode>(statuses[i].error_code()),
                                     absl::StrCat("worker rank ", i, ": ", statuses[i].error_message())),
                        reasons[i]);
  return gen->index;
}

absl::StatusOr<int64_t> WorkerPool::LoadLmHead(const internal::v1::LmHeadLoad& load) {
  return OnEveryWorker(
      [&load](internal::v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
        internal::v1::LoadLmHeadReply reply;
        return stub.LoadLmHead(ctx, load, &reply);
      },
      options_.work_timeout);
}

bool WorkerPool::DropLmHead(const internal::v1::LmHeadRef& head) {
  return OnEveryWorker(
             [&head](internal::v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
               internal::v1::DropLmHeadReply reply;
               return stub.DropLmHead(ctx, head, &reply);
             },
             std::chrono::seconds(30))
      .ok();
}

absl::Status WorkerPool::StageLmHeadRows(const internal::v1::LmHeadStage& stage) {
  return OnWorker(
             0,
             [&stage](internal::v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
               internal::v1::LmHeadStageReply reply;
               return stub.StageLmHeadRows(ctx, stage, &reply);
             },
             options_.work_timeout)
      .status();
}

absl::StatusOr<v1::HeadGradientsChunk> WorkerPool::ReadHeadGradients(
    int rank, const internal::v1::WorkerHeadGradientsRequest& req) {
  v1::HeadGradientsChunk piece;
  LOGPROB_RETURN_IF_ERROR(OnWorker(
                              static_cast<size_t>(rank),
                              [&](internal::v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
                                return stub.ReadHeadGradients(ctx, req, &piece);
                              },
                              options_.work_timeout)
                              .status());
  return piece;
}

absl::Status WorkerPool::CloseHeadGradientStep(const std::string& step) {
  v1::CloseHeadGradientStepRequest req;
  req.set_gradient_step(step);
  return OnEveryWorker(
             [&req](internal::v1::Worker::Stub& stub, grpc::ClientContext* ctx) {
               v1::CloseHeadGradientStepResponse reply;
               return stub.CloseHeadGradientStep(ctx, req, &reply);
             },
             options_.work_timeout)
      .status();
}

bool WorkerPool::Serving(int64_t index) {
  const std::shared_ptr<Generation> gen = current();
  if (!gen || gen->index != index) return false;
  absl::MutexLock lock(&gen->mu);
  return gen->ready && !gen->failed;
}

bool WorkerPool::stopping() {
  absl::MutexLock lock(&mu_);
  return stop_;
}

bool WorkerPool::draining() {
  absl::MutexLock lock(&mu_);
  return draining_;
}

void WorkerPool::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

void WorkerPool::Publish() {
  absl::MutexLock publish(&publish_mu_);
  bool up = false;
  if (const auto gen = current()) {
    absl::MutexLock lock(&gen->mu);
    up = gen->ready && !gen->failed;
  }
  serving_ = up;
  if (options_.on_serving) options_.on_serving(up);
}

void WorkerPool::Fail(const std::shared_ptr<Generation>& gen, const std::string& why) {
  {
    absl::MutexLock lock(&gen->mu);
    if (gen->failed) return;
    gen->failed = true;
    gen->failure = why;
    for (grpc::ClientContext* ctx : gen->inflight) ctx->TryCancel();
  }
  Publish();
  LogLine() << "logprob-server: worker pool generation " << gen->index << " failed: " << why
            << (draining() ? "; draining: not re-forming the pool" : "; re-forming the pool");
  cv_.SignalAll();  // wakes the supervisor
}

void WorkerPool::OnLeave(int64_t generation, const std::string& why) {
  if (stopping()) return;
  if (const auto gen = current(); gen && gen->index == generation) Fail(gen, why);
}

void WorkerPool::Supervise() {
  while (!stopping()) {
    const std::shared_ptr<Generation> gen = current();
    bool failed = !gen;  // none yet (waiting launcher) counts as failed: form one
    if (gen) {
      absl::MutexLock lock(&gen->mu);
      failed = gen->failed;
    }
    if (!failed) {
      if (auto why = launcher_->Poll()) {
        Fail(gen, *why);
        continue;
      }
      absl::MutexLock lock(&mu_);
      if (!stop_) cv_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
      continue;
    }
    {
      // Draining: a failed (or never formed) pool stays so until the stop.
      absl::MutexLock lock(&mu_);
      if (draining_) {
        if (!stop_) cv_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
        continue;
      }
    }
    // Re-form: stop the rest of the failed generation, then form the next.
    launcher_->Stop();
    if (auto st = Form(gen ? gen->index + 1 : 0); !st.ok()) {
      launcher_->Stop();
      if (stopping()) break;
      Fail(current(), absl::StrCat("forming the pool failed: ", st.message()));
      // Wait a second before the next try, or until stopped.
      absl::MutexLock lock(&mu_);
      const absl::Time until = absl::Now() + absl::Seconds(1);
      while (!stop_ && !cv_.WaitWithDeadline(&mu_, until)) {
      }
      continue;  // the next round forms the generation after
    }
    if (gen) {
      ++restarts_;
      if (options_.on_restart) options_.on_restart();
    }
  }
}

absl::StatusOr<std::vector<internal::v1::WorkResult>> WorkerPool::Run(const Plan& plan, const RunBounds& bounds) {
  if (plan.layout == internal::v1::TOKEN_PARALLEL) return RunItems(plan, bounds);
  absl::MutexLock collective(&collective_mu_);
  return RunItems(plan, bounds);
}

void WorkerPool::StopRun(Generation& gen, const Plan& plan, uint64_t run_id) {
  std::set<int> workers;
  for (const PlannedItem& p : plan.items) workers.insert(p.worker);
  std::vector<std::thread> threads;
  for (const int w : workers)
    threads.emplace_back([&gen, w, run_id] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      internal::v1::StopRequest req;
      req.set_run_id(run_id);
      internal::v1::StopReply reply;
      // A worker that cannot be told is gone or hung: its Run call fails
      // (UNAVAILABLE, or work_timeout) and the pool re-forms.
      (void)gen.stubs[w]->Stop(&ctx, req, &reply);
    });
  for (auto& t : threads) t.join();
}

absl::StatusOr<std::vector<internal::v1::WorkResult>> WorkerPool::RunItems(const Plan& plan, const RunBounds& bounds) {
  const std::shared_ptr<Generation> gen = current();
  if (!gen) return absl::UnavailableError("the worker pool is waiting for its workers to join; retry shortly");
  const size_t n = plan.items.size();
  const uint64_t run_id = next_run_id_.fetch_add(1);
  // The calls are bounded by work_timeout only (a hung worker), never by
  // the client's deadline or cancellation: cancelling a call could keep a
  // rank from ever starting its item while its peers wait in the item's
  // collectives, and the ranks would then pair one item's collectives
  // with the next one's. The client's end is sent to the workers as Stop.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(n);
  const auto deadline = std::chrono::system_clock::now() + options_.work_timeout;
  {
    absl::MutexLock lock(&gen->mu);
    if (gen->failed)
      return absl::UnavailableError("the worker pool is re-forming after a worker failure; retry shortly");
    if (!gen->ready) return absl::UnavailableError("the worker pool is waiting for its workers to join; retry shortly");
    for (auto& ctx : contexts) {
      ctx = std::make_unique<grpc::ClientContext>();
      ctx->set_deadline(deadline);
      ctx->AddMetadata(kRunIdMetadataKey, absl::StrCat(run_id));
      ctx->AddMetadata(kGenerationMetadataKey, absl::StrCat(gen->index));
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
  // Wait for every call, stopping the run once the client goes away or
  // its deadline passes.
  bool cancelled = false;
  bool stopped = false;
  {
    std::unique_lock<std::mutex> lock(done_mu);
    while (!done_cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return done == n; })) {
      if (!stopped && bounds.ended()) {
        stopped = true;
        cancelled = bounds.cancelled_now();
        lock.unlock();
        StopRun(*gen, plan, run_id);
        lock.lock();
      }
    }
  }
  for (auto& t : threads) t.join();
  std::string failure;
  {
    absl::MutexLock lock(&gen->mu);
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
  if (cancelled || bounds.cancelled_now()) return absl::CancelledError("the request was cancelled by the client");
  // A worker that is gone or whose GPU faulted (UNAVAILABLE) re-forms the
  // pool even when a peer's own error comes first (e.g. RESOURCE_EXHAUSTED
  // naming the faulted rank from a one-pass agreement).
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i].error_code() == grpc::StatusCode::UNAVAILABLE) {
      const std::string msg = absl::StrCat("worker ", plan.items[i].worker, ": ", statuses[i].error_message());
      Fail(gen, msg);
      return absl::UnavailableError(absl::StrCat("worker pool failed (", msg, "); it is being re-formed, retry"));
    }
  }
  // The error sent back: the first whose worker gave a reason (the rank
  // that failed, rather than a peer that only saw it fail), else the first.
  std::vector<size_t> order;
  for (size_t i = 0; i < n; ++i)
    if (!statuses[i].ok() && SentReason(*contexts[i]) != v1::ERROR_REASON_UNSPECIFIED) order.push_back(i);
  for (size_t i = 0; i < n; ++i) order.push_back(i);
  for (const size_t i : order) {
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
    // The worker's reason, unchanged (e.g. CUDA_IPC_UNAVAILABLE only
    // from a worker that could not open the client's handle).
    return WithReason(absl::Status(FromGrpc(statuses[i]).code(), msg), SentReason(*contexts[i]));
  }
  return results;
}

}  // namespace logprob
