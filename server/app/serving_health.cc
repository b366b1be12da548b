#include "server/app/serving_health.h"

#include <chrono>
#include <csignal>
#include <thread>

#include "common/log_line.h"
#include "common/malloc_tuning.h"

namespace logprob {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

}  // namespace

void ServingHealth::SetServer(grpc::Server* server) { server_ = server; }

void ServingHealth::SetPoolUp(bool up) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pool_up_ = up;
  }
  Publish();
}

void ServingHealth::SetHeadsSynced() {
  heads_synced_ = true;
  Publish();
}

std::function<absl::Status()> ServingHealth::HeadsReady() {
  return [this]() -> absl::Status {
    if (heads_synced_) return absl::OkStatus();
    return absl::UnavailableError(
        "this front-end is catching up with its peers' lm_head versions (--lm-head-sync-from); try another replica");
  };
}

void ServingHealth::Publish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (grpc::Server* s = server_.load(); s && !g_stop)
    s->GetHealthCheckService()->SetServingStatus(pool_up_ && heads_synced_);
}

void InstallStopSignals() {
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
}

bool StopRequested() { return g_stop; }

void WaitForStopSignal() {
  for (int tick = 1; !g_stop; ++tick) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (tick % 10 == 0) TrimKeptFreedMemory();
  }
}

void Drain(WorkerPool& pool, grpc::Server& server, int grace_seconds) {
  LogLine() << "logprob-server: SIGTERM: NOT_SERVING, draining for up to " << grace_seconds << " s";
  pool.Drain();  // a worker that leaves now fails its calls but starts no new pool
  server.GetHealthCheckService()->SetServingStatus(false);
  server.Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(grace_seconds));
  LogLine() << "logprob-server: drained; stopping workers";
}

}  // namespace logprob
