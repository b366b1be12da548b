// logprob-server: the front-end. Spawns the local worker pool (or, in
// cluster mode, waits for external workers to join), then serves the
// public LogprobService, grpc.health.v1 and server reflection.
//
// This file is the wiring only: the flags and their checks are in
// server_flags.h, the start-up heads in startup_heads.h, the update
// protocol's adapters in update_wiring.h, the peer sync's options in
// peer_sync_setup.h, the health status and the drain in serving_health.h.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <climits>
#include <filesystem>
#include <iostream>
#include <optional>
#include <utility>

#include "common/exclusive_port.h"
#include "common/lm_head_store_name.h"
#include "common/log_line.h"
#include "common/malloc_tuning.h"
#include "common/shared_memory.h"
#include "server/app/internal_plane.h"
#include "server/app/lm_head_cpu_kernel_setup.h"
#include "server/app/memory_bound.h"
#include "server/app/peer_sync_setup.h"
#include "server/app/server_flags.h"
#include "server/app/serving_health.h"
#include "server/app/startup_heads.h"
#include "server/app/update_wiring.h"
#include "server/heads/lm_head_updates.h"
#include "server/heads/lm_heads.h"
#include "server/heads/store_folder.h"
#include "server/inputs/input_resolver.h"
#include "server/metrics/metrics.h"
#include "server/pool/external_launcher.h"
#include "server/pool/lm_head_files.h"
#include "server/pool/local_launcher.h"
#include "server/pool/worker_pool.h"
#include "server/transport/auth.h"
#include "server/transport/lm_head_peer_sync.h"
#include "server/transport/scoring_service.h"
#include "server/transport/tls.h"

using logprob::LogLine;

namespace {

int Fail(const std::string& msg) {
  LogLine() << "logprob-server: " << msg;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  logprob::ServerFlags flags = logprob::ParseServerFlags(argc, argv);
  if (auto st = logprob::CheckPoolFlags(flags); !st.ok()) return Fail(std::string(st.message()));
  logprob::KeepFreedMemory(flags.keep_freed_memory_bytes);  // before any thread starts
  const int external = flags.external_workers;
  const int workers = flags.pool_workers;
  logprob::FrontendMemoryLimits memory_limits{flags.max_queue_bytes, flags.max_request_bytes,
                                              flags.keep_freed_memory_bytes,
                                              /*payload_regions=*/!flags.cluster() && flags.shared_memory};
  const absl::StatusOr<int64_t> store_bound = logprob::LmHeadStoreBound(flags);
  if (!store_bound.ok()) return Fail(std::string(store_bound.status().message()));
  memory_limits.lm_head_store_bytes = *store_bound;
  const logprob::FrontendMemoryBound memory_bound = logprob::ComputeFrontendMemoryBound(memory_limits);
  if (flags.print_memory_bound) {
    // One line for people and scripts (tests/deploy/check_deploy.py reads the key=value fields).
    std::cout
        << "frontend_bytes=" << memory_bound.total() << " local_workers=" << (external > 0 ? 0 : workers)
        << " worker_base_bytes=" << logprob::kWorkerBaseBytes << " (front-end " << memory_bound.Describe()
        << "; each local worker adds its lm_head slice of up to --lm-head-retain + 1 versions of each head, and one "
           "hidden-states round)"
        << std::endl;
    return 0;
  }
  if (auto st = logprob::CheckServingFlags(flags); !st.ok()) return Fail(std::string(st.message()));

  absl::StatusOr<logprob::InternalPlane> plane = logprob::ChooseInternalPlane(
      flags.internal_secret_file, flags.insecure_internal_plane, flags.cluster(), flags.control_listen);
  if (!plane.ok()) return Fail(std::string(plane.status().message()));
  LogLine() << "logprob-server: " << plane->description;
  std::unique_ptr<logprob::WorkerLauncher> launcher;
  if (external > 0) {
    launcher = std::make_unique<logprob::ExternalLauncher>(external);
  } else {
    std::string worker_binary = flags.worker_binary;
    if (worker_binary.empty())
      worker_binary = (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "logprob-worker").string();
    if (access(worker_binary.c_str(), X_OK) != 0) return Fail("worker binary " + worker_binary + " is not executable");
    int secret_fd = -1;
    if (plane->secret) {
      absl::StatusOr<int> fd = plane->secret->ToInheritableFd();
      if (!fd.ok()) return Fail(std::string(fd.status().message()));
      secret_fd = *fd;
    }
    launcher = std::make_unique<logprob::LocalLauncher>(workers, worker_binary, std::vector<std::string>{}, secret_fd);
  }

  if (const int stale = logprob::RemoveStaleRegions(); stale > 0)
    LogLine() << "logprob-server: removed " << stale << " shared memory region(s) left by exited servers";
  logprob::Metrics metrics(flags.backend);
  if (!flags.metrics_listen.empty()) {
    try {
      metrics.Expose(flags.metrics_listen);
    } catch (const std::exception& e) {
      return Fail("cannot listen on --metrics-listen " + logprob::ListenFailure(flags.metrics_listen) + " (" +
                  e.what() + ")");
    }
  }

  logprob::ServiceConfig config = logprob::ServiceConfigFromFlags(flags);
  metrics.memory().SetBound(memory_bound.total());
  LogLine() << "logprob-server: memory bound " << memory_bound.Describe();
  logprob::internal::v1::JoinReply worker_config = logprob::WorkerConfigFromFlags(flags, memory_limits.payload_regions);

  // Named lm_heads: --lm-head [NAME=]PATH[:TENSOR] and --lm-head-declare, repeatable.
  auto releases = std::make_shared<logprob::LmHeadReleases>();
  logprob::LmHeads::Options heads_options;
  heads_options.retain = flags.lm_head_retain;
  heads_options.precision_of = config.lm_head_precision;
  heads_options.on_release = [releases](const logprob::LmHeadVersion& v) { releases->Push(v); };
  heads_options.frozen.insert(flags.lm_head_frozen.begin(), flags.lm_head_frozen.end());
  logprob::LmHeads heads(heads_options);
  if (auto st = logprob::AddStartupHeads(flags, heads); !st.ok()) return Fail(std::string(st.message()));
  config.lm_heads = &heads;
  // The CPU pool's one bf16 GEMM kernel (auto: measured here, once).
  absl::StatusOr<std::string> cpu_kernel = logprob::ResolveLmHeadCpuKernel(flags, heads, worker_config.threads());
  if (!cpu_kernel.ok()) return Fail(std::string(cpu_kernel.status().message()));
  worker_config.set_lm_head_cpu_kernel(*cpu_kernel);
  config.lm_head_cpu_kernel = *cpu_kernel;
  absl::StatusOr<std::unique_ptr<logprob::StoreFolder>> store_folder =
      logprob::MakeStoreFolder(flags.lm_head_store_dir);
  if (!store_folder.ok()) return Fail("--lm-head-store-dir: " + std::string(store_folder.status().message()));
  config.lm_head_store_bytes = [dir = (*store_folder)->path()] { return logprob::LmHeadStore::BytesOf(dir); };
  if (config.lm_head_updates && heads.empty()) return Fail("--allow-lm-head-updates needs an --lm-head to update");
  // A replica catching up with its peers serves no hidden-states request
  // (UNAVAILABLE) and reports NOT_SERVING until it holds their versions.
  const std::string& sync_from = flags.lm_head_sync_from;
  logprob::ServingHealth health(/*heads_synced=*/sync_from.empty());
  config.lm_heads_ready = health.HeadsReady();

  // Security of the public port. The control plane and the workers' ports
  // carry no TLS: loopback by default, a private network in cluster mode.
  auto credentials = logprob::ServerCredentialsFromFiles(flags.tls_cert, flags.tls_key, flags.tls_client_ca);
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  std::optional<logprob::BearerTokenAuth> auth;
  if (const std::string& file = flags.auth_token_file; !file.empty()) {
    auto loaded = logprob::BearerTokenAuth::FromFile(file);
    if (!loaded.ok()) return Fail("--auth-token-file " + std::string(loaded.status().message()));
    auth = *std::move(loaded);
  }
  std::optional<logprob::BearerTokenAuth> update_auth;
  if (const std::string& file = flags.update_token_file; !file.empty()) {
    auto loaded = logprob::BearerTokenAuth::FromFile(file);
    if (!loaded.ok()) return Fail("--update-token-file " + std::string(loaded.status().message()));
    if (auth && loaded->SameTokenAs(*auth))
      return Fail("--update-token-file " + file + " holds the --auth-token-file token: the rights would not differ");
    update_auth = *std::move(loaded);
  } else if (auth && config.lm_head_updates) {
    LogLine() << "logprob-server: warning: --allow-lm-head-updates with --auth-token-file and no "
                 "--update-token-file: every scoring client may also update lm_heads";
  }

  // Where updated lm_head versions are written (before the pool: workers on
  // other nodes fetch rows of its files through the control plane).
  const std::string lm_head_store_dir = (*store_folder)->path();

  logprob::WorkerPool::Options pool_opts;
  pool_opts.worker_config = worker_config;
  // The only folder the workers write staged update rows in.
  pool_opts.worker_config.set_lm_head_store_dir(lm_head_store_dir);
  pool_opts.lm_heads = [&heads] { return heads.Alive(); };
  // Workers that cannot read a head's file (another node) fetch its rows
  // from here: the files of live versions and of the update store only.
  pool_opts.lm_head_files = [&heads, store = lm_head_store_dir](const std::string& file) {
    return logprob::IsCommittedStoreFile(file, store) || logprob::IsLiveLmHeadFile(file, heads.Alive());
  };
  pool_opts.workers = workers;
  pool_opts.auth = plane->auth;
  pool_opts.control_listen = flags.control_listen;
  pool_opts.join_timeout = std::chrono::seconds(flags.worker_join_timeout);
  // Health: SERVING while the pool is up and the heads caught up with the peers.
  pool_opts.on_serving = [&](bool up) {
    health.SetPoolUp(up);
    metrics.SetWorkersUp(up ? workers : 0);
  };
  pool_opts.on_restart = [&] { metrics.AddWorkerRestart(); };
  pool_opts.join_observers.on_waiting = [&](int waiting) { metrics.SetWorkersWaiting(waiting); };
  pool_opts.join_observers.on_refused = [&] { metrics.AddJoinRefused(); };
  logprob::WorkerPool pool(pool_opts, std::move(launcher));

  // lm_head updates: staged in the store directory, loaded by every worker, then committed.
  logprob::PublishLmHeads(metrics, heads);
  // One resolver of references (shared memory, CUDA IPC) for requests and update rows alike.
  logprob::InputResolverOptions input_opts =
      logprob::InputResolverOptionsFromFlags(flags, pool.size(), pool.same_host());
  input_opts.shared_memory_regions.on_change = [&metrics](int64_t regions, int64_t bytes) {
    metrics.SetSharedMemory(regions, bytes);
  };
  logprob::InputResolver inputs(std::move(input_opts));
  logprob::LmHeadUpdates::Options update_opts = logprob::LmHeadUpdateOptionsFromFlags(flags, lm_head_store_dir);
  update_opts.inputs = &inputs;
  logprob::LmHeadUpdates updates(update_opts, &heads, releases, logprob::LmHeadWorkersOf(pool),
                                 logprob::LmHeadUpdateObserversOf(metrics, heads));
  logprob::ScoringService service(
      pool, config, inputs, &metrics, &updates,
      logprob::AccessPolicy(auth ? &*auth : nullptr, update_auth ? &*update_auth : nullptr));

  // Serve health (NOT_SERVING until the pool is up) while workers start.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  logprob::ExclusivePorts(builder);  // a second server on this port fails instead of sharing it
  builder.AddListeningPort(flags.listen, *credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_request_bytes));
  builder.SetMaxSendMessageSize(INT_MAX);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server || port == 0) return Fail("cannot listen on --listen " + logprob::ListenFailure(flags.listen));
  server->GetHealthCheckService()->SetServingStatus(false);
  health.SetServer(server.get());
  logprob::InstallStopSignals();

  LogLine() << "logprob-server: listening on " << flags.listen
            << (flags.tls_cert.empty()        ? " (plaintext)"
                : flags.tls_client_ca.empty() ? " (TLS)"
                                              : " (mutual TLS)")
            << (auth ? " with bearer-token auth" : "") << (update_auth ? " and an update token" : "") << ", "
            << (external > 0 ? "waiting for " : "starting ") << workers << (external > 0 ? " external" : "")
            << " worker(s)";
  if (auto st = pool.Start(); !st.ok()) {
    server->Shutdown();
    return Fail("worker pool: " + std::string(st.message()));
  }
  if (!sync_from.empty()) {
    auto synced = logprob::SyncLmHeadsFromPeers(logprob::PeerSyncOptionsFromFlags(flags), heads, updates);
    if (!synced.ok()) {
      server->Shutdown();
      return Fail("--lm-head-sync-from " + sync_from + ": " + std::string(synced.status().message()));
    }
    health.SetHeadsSynced();
    LogLine() << "logprob-server: lm_heads caught up with the peers (" << synced->size() << " head(s) checked)";
  }
  if (external == 0) LogLine() << "logprob-server: " << workers << " worker(s) joined; SERVING";

  logprob::WaitForStopSignal();
  logprob::Drain(pool, *server, flags.shutdown_grace);
  return 0;
}
