// logprob-server: the front-end. Spawns the local worker pool (or, in
// cluster mode, waits for external workers to join), then serves the
// public LogprobService, grpc.health.v1 and server reflection.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/backend_choice.h"
#include "common/channel.h"
#include "common/exclusive_port.h"
#include "common/flag_names.h"
#include "common/lm_head_precision.h"
#include "common/lm_head_source.h"
#include "common/log_line.h"
#include "common/loopback.h"
#include "common/malloc_tuning.h"
#include "common/partition.h"
#include "common/sha256.h"
#include "common/shared_memory.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "server/app/internal_plane.h"
#include "server/app/memory_bound.h"
#include "server/heads/lm_head_declared.h"
#include "server/heads/lm_head_updates.h"
#include "server/heads/lm_heads.h"
#include "server/heads/store_folder.h"
#include "server/metrics/metrics.h"
#include "server/pool/external_launcher.h"
#include "server/pool/lm_head_files.h"
#include "server/pool/local_launcher.h"
#include "server/pool/worker_pool.h"
#include "server/transport/auth.h"
#include "server/transport/lm_head_peer_sync.h"
#include "server/transport/scoring_service.h"
#include "server/transport/tls.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address of the public gRPC service");
ABSL_FLAG(int, workers, 1, "number of local worker processes to spawn");
ABSL_FLAG(int, external_workers, 0,
          "cluster mode: spawn nothing, wait for this many logprob-worker processes started elsewhere with "
          "--frontend pointing at --control-listen (which then needs a reachable address and a fixed port)");
ABSL_FLAG(std::string, backend, "cpu",
          "compute backend of the workers: cpu, or cuda (one GPU per worker, rank % GPUs; workers may share a GPU "
          "with --comm gloo)");
ABSL_FLAG(std::string, comm, "gloo", "worker communicator: gloo, or nccl (needs --backend cuda and a GPU per worker)");
ABSL_FLAG(std::string, parallelism, "auto", "logits layout: auto (by cost), token or vocab");
ABSL_FLAG(std::string, lm_head, "",
          "an lm_head for hidden-states requests, repeatable: [NAME=]PATH[:TENSOR], NAME (default \"default\") "
          "the head's name requests give in `head`, PATH a .safetensors file, a model.safetensors.index.json or "
          "a checkpoint directory; TENSOR defaults to lm_head.weight, then model.embed_tokens.weight (tied "
          "embeddings). The head's bias (lm_head.bias) is read beside the weight, and a directory's config.json "
          "gives its logit multiplier and final-logit softcap; a config with a logit transform the server cannot "
          "reproduce is refused (docs/serving.md \"Head transforms\")");
ABSL_FLAG(std::string, lm_head_logit_scale, "",
          "logit multiplier of every --lm-head without a config.json (a .safetensors file or index): logits are "
          "softcap(SCALE * (h W^T + b)); a number > 0 (default 1). A checkpoint directory's config.json gives it "
          "(logit_scale, output_multiplier, lm_head_multiplier, 1 / logits_scaling); a flag that contradicts it "
          "is an error");
ABSL_FLAG(std::string, lm_head_softcap, "",
          "final-logit softcap C of every --lm-head without a config.json: logits are C * tanh(z / C) after the "
          "bias and multiplier; a number >= 0 (default 0: none). A checkpoint directory's config.json gives it "
          "(final_logit_softcapping); a flag that contradicts it is an error");
ABSL_FLAG(std::string, lm_head_declare, "",
          "an lm_head declared by shape and dtype, repeatable: NAME=VxH:DTYPE (e.g. policy=151936x4096:bf16; "
          "DTYPE bf16, f16 or f32). It needs no checkpoint file, needs --allow-lm-head-updates, and serves once "
          "the first update fills it (requests before: FAILED_PRECONDITION)");
ABSL_FLAG(std::string, lm_head_version, "initial", "version name of the lm_heads loaded at start");
ABSL_FLAG(std::string, lm_head_frozen, "",
          "an --lm-head NAME that lm_head updates may not change (a reference or a teacher), repeatable; "
          "updates to it fail with FAILED_PRECONDITION, and GetServerInfo lists it as frozen");
ABSL_FLAG(int, lm_head_retain, 1,
          "committed versions of each lm_head kept servable (requests may pin them with head_version), the "
          "current one included");
ABSL_FLAG(bool, allow_lm_head_updates, false,
          "accept lm_head updates (BeginLmHeadUpdate / PutLmHeadRows / CommitLmHeadUpdate); with "
          "--update-token-file they need that token, else with --auth-token-file that one");
ABSL_FLAG(std::string, lm_head_update_dir, "",
          "directory lm_head updates may read checkpoints from (LmHeadRows.file, relative to it; no \"..\", no "
          "symlinks out); empty: file sources refused");
ABSL_FLAG(std::string, lm_head_store_dir, "",
          "where updated lm_head versions are written (safetensors; workers read their slices from it, also "
          "after re-forming: in cluster mode a directory every worker sees at the same path); each front-end "
          "writes only into its own folder logprob-lm-heads-PID-START-RANDOM under it, locked while it runs and "
          "removed at exit (a dead front-end's is removed by the next start); default /dev/shm (memory), else "
          "$TMPDIR (logged)");
ABSL_FLAG(absl::Duration, lm_head_update_timeout, absl::Seconds(300),
          "an open lm_head update without progress this long is aborted and its memory freed");
ABSL_FLAG(std::string, lm_head_sync_from, "",
          "gRPC target of the other front-ends of a replicated deployment (dns:///HEADLESS-SERVICE:PORT, "
          "HOST:PORT[,HOST:PORT...] or ipv4:IP:PORT,IP:PORT): before serving, pull from them the newest updated "
          "version of each head (needs --allow-lm-head-updates; docs/lm-head-updates.md \"What replicas see\")");
ABSL_FLAG(absl::Duration, lm_head_sync_timeout, absl::Seconds(600),
          "longest --lm-head-sync-from may take to read one version from a peer");
ABSL_FLAG(std::string, lm_head_sync_tls_ca, "",
          "PEM CA certificate(s) of the peers' TLS certificates: --lm-head-sync-from over TLS (presenting "
          "--tls-cert/--tls-key as client certificate when given)");
ABSL_FLAG(std::string, lm_head_sync_tls_server_name, "",
          "name to verify in the peers' certificates instead of their addresses (with --lm-head-sync-tls-ca)");
ABSL_FLAG(int64_t, lm_head_memory_bytes, 0,
          "per worker cap on the bytes of lm_head versions held (retained, pinned and one staged update); an "
          "update over it is refused; 0: no cap");
ABSL_FLAG(int64_t, hidden_chunk_tokens, 128,
          "hidden-states rows each worker adds per GEMM round; a worker's logits buffer is about "
          "this * V * 4 bytes whatever the request size (CPU workers; CUDA workers score an item "
          "in one pass unless it has sampling filters)");
ABSL_FLAG(std::string, lm_head_precision, "auto",
          "operands of the lm_head GEMM (f32 accumulation and logits in every case): auto (bf16 for BF16 "
          "weights, fp32 for F32 / F16 weights), bf16 (weights and hidden states rounded to bf16), tf32 (GPU: "
          "TF32 tensor cores; CPU: both operands rounded to tf32, f32 GEMM) or fp32 (exact f32 operands, e.g. for "
          "a rollout engine computing the head in fp32)");
ABSL_FLAG(int, worker_threads, 0, "compute threads per worker (0: cores / workers)");
ABSL_FLAG(std::string, metrics_listen, "", "host:port for Prometheus /metrics (off when empty)");
ABSL_FLAG(std::string, control_listen, "127.0.0.1:0",
          "address of the internal worker control plane (cluster mode: e.g. 0.0.0.0:50052)");
ABSL_FLAG(std::string, internal_secret_file, "",
          "file holding the pool secret (16+ printable characters, not readable by other users) that every call of "
          "the internal plane (control port, worker ports) must carry; give the workers the same file. Default: a "
          "secret made at start for the local workers (cluster mode beyond loopback needs this flag or "
          "--insecure-internal-plane)");
ABSL_FLAG(bool, insecure_internal_plane, false,
          "run the internal plane without authentication: anyone reaching the control or worker ports can join the "
          "pool and read heads and work items (only on a network the pool alone reaches)");
ABSL_FLAG(std::string, worker_binary, "", "path of logprob-worker (default: beside this binary)");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{1} << 30,
          "largest accepted request, bytes: one message (Score, ScoreStream), or all parts of a chunked request "
          "(ScoreChunked)");
ABSL_FLAG(int64_t, keep_freed_memory_bytes, -1,
          "freed heap memory the front-end keeps mapped for reuse (large requests then reuse pages instead of "
          "faulting in fresh ones, common/malloc_tuning.h); -1 (default): --max-request-bytes, one largest "
          "request's pages; 0: glibc's defaults");
ABSL_FLAG(bool, print_memory_bound, false,
          "print the front-end's memory bound for the other flags (docs/serving.md, Memory sizing) and exit");
ABSL_FLAG(int64_t, max_tokens_per_request, int64_t{1} << 22, "largest accepted request, token rows");
ABSL_FLAG(int, max_topk, 1024, "largest K of topk outputs and gather_indices");
ABSL_FLAG(int, worker_join_timeout, 60,
          "seconds the workers get to become ready (cluster mode: counted from the last join; joining "
          "itself is not timed)");
ABSL_FLAG(int, shutdown_grace, 30, "seconds in-flight requests get to finish after SIGTERM");
ABSL_FLAG(int64_t, max_queue_tokens, int64_t{1} << 23,
          "token rows accepted and not yet answered; beyond it requests get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queue_bytes, int64_t{2} << 30,
          "request bytes accepted and not yet answered; beyond it requests get RESOURCE_EXHAUSTED");
ABSL_FLAG(absl::Duration, max_queue_delay, absl::Milliseconds(2),
          "longest a request waits in the batching queue for others to share its worker batch while other "
          "batches run (an idle pool starts it at once; e.g. 2ms; 0: batch only what is already queued)");
ABSL_FLAG(int64_t, max_batch_tokens, 8192, "token rows per worker batch (a larger request runs alone)");
ABSL_FLAG(bool, shared_memory, true,
          "hand payloads to workers on this host through POSIX shared memory (/dev/shm) instead of gRPC");
ABSL_FLAG(bool, shared_memory_inputs, true,
          "accept input tensors from same-host clients as references into POSIX shared-memory regions they "
          "register (RegisterSharedMemory)");
ABSL_FLAG(bool, cuda_ipc_inputs, true,
          "accept hidden states from same-host clients as CUDA IPC handles of their GPU memory "
          "(Tensor.cuda_ipc); effective only with --backend cuda and workers started by this server");
ABSL_FLAG(int64_t, max_shared_memory_bytes, int64_t{16} << 30,
          "byte_size of all clients' registered shared-memory regions together (RESOURCE_EXHAUSTED beyond)");
ABSL_FLAG(int, max_shared_memory_regions, 64,
          "registered shared-memory regions of all clients together (RESOURCE_EXHAUSTED beyond)");
ABSL_FLAG(absl::Duration, shared_memory_idle_timeout, absl::Minutes(5),
          "a shared-memory session (client) that makes no call for this long loses its regions");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve --listen over TLS (needs --tls-key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificate(s): require client certificates signed by them (mutual TLS; needs --tls-cert)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token every LogprobService call must send as 'authorization: Bearer TOKEN' "
          "(health and reflection stay open)");
ABSL_FLAG(std::string, update_token_file, "",
          "file holding the bearer token lm_head update calls (Begin/Put/Commit/Abort) must send; the "
          "--auth-token-file token is then refused for them (PERMISSION_DENIED); this token may also score");

using logprob::LogLine;

namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

int Fail(const std::string& msg) {
  LogLine() << "logprob-server: " << msg;
  return 1;
}

/// Checks the flags of cluster mode (--external-workers N): exclusive with
/// --workers, and a --control-listen the workers can find (fixed port).
absl::Status CheckClusterFlags(int external, bool workers_given, const std::string& control_listen) {
  if (external < 0) return absl::InvalidArgumentError("--external-workers must be >= 1 (0: spawn --workers locally)");
  if (external == 0) return absl::OkStatus();
  if (workers_given)
    return absl::InvalidArgumentError(
        "--workers and --external-workers are mutually exclusive: --workers N spawns N local workers, "
        "--external-workers N waits for N workers started elsewhere");
  const size_t colon = control_listen.rfind(':');
  if (colon == std::string::npos || control_listen.substr(colon + 1) == "0")
    return absl::InvalidArgumentError(absl::StrCat(
        "--external-workers needs --control-listen HOST:PORT with a fixed port the workers' --frontend names "
        "(e.g. 0.0.0.0:50052), not ",
        control_listen));
  const std::string host = control_listen.substr(0, colon);
  if (logprob::IsLoopbackHost(host))
    LogLine() << "logprob-server: --control-listen " << control_listen
              << " is loopback: only workers on this host can join (use 0.0.0.0:PORT for a cluster)";
  return absl::OkStatus();
}

}  // namespace

namespace {

/// The lm_head store's folder of this process start (server/heads/store_folder.h)
/// under --lm-head-store-dir, or by default under /dev/shm (memory: no disk
/// writeback on the update path), else under $TMPDIR (the reason logged).
/// Stale folders of exited front-ends under the root are removed first.
absl::StatusOr<std::unique_ptr<logprob::StoreFolder>> MakeStoreFolder(const std::string& flag) {
  int stale = 0;
  std::string root = flag.empty() ? "/dev/shm" : flag;
  absl::StatusOr<std::unique_ptr<logprob::StoreFolder>> folder = logprob::StoreFolder::Make(root, &stale);
  if (!folder.ok() && flag.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    const std::string fallback = std::string(tmp && *tmp ? tmp : "/tmp");
    LogLine() << "logprob-server: lm_head store: cannot use /dev/shm (" << folder.status().message()
              << "); using a folder under " << fallback << " instead (on disk: updates may be slower)";
    root = fallback;
    folder = logprob::StoreFolder::Make(root, &stale);
  }
  if (!folder.ok()) return folder.status();
  if (stale > 0)
    LogLine() << "logprob-server: removed " << stale << " stale lm_head store(s) of exited front-ends under " << root;
  LogLine() << "logprob-server: lm_head store " << (*folder)->path();
  return folder;
}

/// A start-up head from "[NAME=]PATH[:TENSOR]": its source, and the
/// SHA-256 of its weight bytes (read once here).
/// The head name and path of an --lm-head [NAME=]PATH[:TENSOR] value: NAME=
/// when what precedes '=' is a name and the whole is not a path.
std::pair<std::string, std::string> SplitLmHeadArg(const std::string& arg) {
  if (const size_t eq = arg.find('='); eq != std::string::npos && !std::filesystem::exists(arg))
    return {arg.substr(0, eq), arg.substr(eq + 1)};
  return {logprob::kDefaultLmHead, arg};
}

/// The lm_head store's part of the memory bound (LmHeadStoreBytes of every
/// --lm-head updates may change: not --lm-head-frozen, from the heads'
/// headers; and of every --lm-head-declare, from its shape); 0 without
/// --allow-lm-head-updates.
absl::StatusOr<int64_t> LmHeadStoreBound(int argc, char** argv, const std::vector<std::string>& lm_head_args) {
  if (!absl::GetFlag(FLAGS_allow_lm_head_updates)) return 0;
  const std::vector<std::string> frozen = logprob::FlagValues(argc, argv, "lm_head_frozen");
  int64_t bytes = 0;
  const auto add = [&bytes](const logprob::LmHeadSource& source) {
    bytes += logprob::LmHeadStoreBytes(
        source.vocab_size * source.hidden_size * static_cast<int64_t>(logprob::DTypeSize(source.dtype)),
        std::max(1, absl::GetFlag(FLAGS_lm_head_retain)));
  };
  for (const std::string& arg : lm_head_args) {
    const auto [name, path] = SplitLmHeadArg(arg);
    if (std::find(frozen.begin(), frozen.end(), name) != frozen.end()) continue;
    auto source = logprob::ResolveLmHead(path, {});
    if (!source.ok())
      return absl::InvalidArgumentError("--lm-head " + arg + ": " + std::string(source.status().message()));
    add(*source);
  }
  // Declared heads (--lm-head-declare NAME=VxH:DTYPE): their shape is the flag's.
  for (const std::string& arg : logprob::FlagValues(argc, argv, "lm_head_declare")) {
    auto declared = logprob::ParseDeclaredLmHead(arg, 1);
    if (!declared.ok())
      return absl::InvalidArgumentError("--lm-head-declare " + arg + ": " + std::string(declared.status().message()));
    add(declared->source);
  }
  return bytes;
}

absl::StatusOr<logprob::LmHeadVersion> LoadStartupHead(const std::string& arg, const std::string& version, int workers,
                                                       const logprob::LmHeadScalarFlags& scalars,
                                                       logprob::LmHeadPrecision precision, bool device) {
  logprob::LmHeadVersion v;
  std::string path;
  std::tie(v.head, path) = SplitLmHeadArg(arg);
  LOGPROB_RETURN_IF_ERROR(logprob::CheckLmHeadName(v.head, "--lm-head NAME"));
  LOGPROB_ASSIGN_OR_RETURN(v.source, logprob::ResolveLmHead(path, scalars));
  v.version = version;
  v.origin = path;
  const int64_t row_bytes = v.source.hidden_size * static_cast<int64_t>(logprob::DTypeSize(v.source.dtype));
  v.bytes_per_worker = logprob::LmHeadWorkerBytes(logprob::SplitRange(v.source.vocab_size, workers, 0).second,
                                                  v.source.hidden_size, v.source.dtype, precision, device);
  const auto t0 = std::chrono::steady_clock::now();
  logprob::Sha256Stream sha;
  std::string buf;
  const int64_t rows_per_read = std::max<int64_t>(1, (int64_t{16} << 20) / row_bytes);
  for (int64_t r = 0; r < v.source.vocab_size; r += rows_per_read) {
    const int64_t e = std::min(v.source.vocab_size, r + rows_per_read);
    buf.resize(static_cast<size_t>((e - r) * row_bytes));
    LOGPROB_RETURN_IF_ERROR(logprob::ReadLmHeadRows(v.source, r, e, buf.data()));
    sha.Update(buf);
  }
  v.sha256 = logprob::KnownSha256(sha.FinishHex());
  logprob::LogLine() << "logprob-server: lm_head \"" << v.head << "\" version " << v.version << ": " << v.source.tensor
                     << " [" << v.source.vocab_size << ", " << v.source.hidden_size << "] "
                     << logprob::DTypeName(v.source.dtype) << " from " << v.source.file
                     << (v.source.tied_embeddings ? " (no lm_head.weight: tied embeddings, using the input embedding)"
                                                  : "")
                     << ", transform " << v.source.transform.ToString()
                     << (v.source.config_file.empty() ? "" : " (" + v.source.config_file + ")") << ", sha256 "
                     << v.sha256.get().substr(0, 16) << "… ("
                     << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)";
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "logprob-server --listen HOST:PORT (--workers N | --external-workers N --control-listen HOST:PORT) "
      "[--backend cpu|cuda] [--comm gloo|nccl] [--lm-head FILE[:TENSOR] [--lm-head-precision auto|bf16|tf32|fp32]] "
      "[--metrics-listen HOST:PORT] "
      "[--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--auth-token-file FILE] [--update-token-file FILE]");
  // --version: the release and whether the build has CUDA (common/version.h).
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return logprob::VersionText("logprob-server"); };
  absl::SetFlagsUsageConfig(usage_config);
  logprob::NormalizeFlagDashes(argc, argv);
  const std::vector<std::string> lm_head_args = logprob::FlagValues(argc, argv, "lm_head");
  const bool workers_given = logprob::FlagGiven(argc, argv, "workers");
  absl::ParseCommandLine(argc, argv);
  int64_t keep_freed = absl::GetFlag(FLAGS_keep_freed_memory_bytes);
  if (keep_freed < -1) return Fail("--keep-freed-memory-bytes must be >= 0, or -1 for --max-request-bytes");
  if (keep_freed == -1) keep_freed = absl::GetFlag(FLAGS_max_request_bytes);
  logprob::KeepFreedMemory(keep_freed);  // before any thread starts
  const int external = absl::GetFlag(FLAGS_external_workers);
  if (auto st = CheckClusterFlags(external, workers_given, absl::GetFlag(FLAGS_control_listen)); !st.ok())
    return Fail(std::string(st.message()));
  const int workers = external > 0 ? external : absl::GetFlag(FLAGS_workers);
  if (workers < 1) return Fail("--workers must be >= 1");
  logprob::FrontendMemoryLimits memory_limits{absl::GetFlag(FLAGS_max_queue_bytes),
                                              absl::GetFlag(FLAGS_max_request_bytes), keep_freed,
                                              /*payload_regions=*/external == 0 && absl::GetFlag(FLAGS_shared_memory)};
  const absl::StatusOr<int64_t> store_bound = LmHeadStoreBound(argc, argv, lm_head_args);
  if (!store_bound.ok()) return Fail(std::string(store_bound.status().message()));
  memory_limits.lm_head_store_bytes = *store_bound;
  const logprob::FrontendMemoryBound memory_bound = logprob::ComputeFrontendMemoryBound(memory_limits);
  if (absl::GetFlag(FLAGS_print_memory_bound)) {
    // One line for people and scripts (tests/deploy/check_deploy.py reads the key=value fields).
    std::cout
        << "frontend_bytes=" << memory_bound.total() << " local_workers=" << (external > 0 ? 0 : workers)
        << " worker_base_bytes=" << logprob::kWorkerBaseBytes << " (front-end " << memory_bound.Describe()
        << "; each local worker adds its lm_head slice of up to --lm-head-retain + 1 versions of each head, and one "
           "hidden-states round)"
        << std::endl;
    return 0;
  }
  if (auto st = logprob::CheckBackendChoice(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_comm)); !st.ok())
    return Fail(std::string(st.message()));
  auto parallelism = logprob::ParseParallelism(absl::GetFlag(FLAGS_parallelism));
  if (!parallelism.ok()) return Fail(std::string(parallelism.status().message()));
  const auto precision = logprob::ParseLmHeadPrecision(absl::GetFlag(FLAGS_lm_head_precision));
  if (!precision.ok()) return Fail(std::string(precision.status().message()));

  absl::StatusOr<logprob::InternalPlane> plane = logprob::ChooseInternalPlane(
      absl::GetFlag(FLAGS_internal_secret_file), absl::GetFlag(FLAGS_insecure_internal_plane), external > 0,
      absl::GetFlag(FLAGS_control_listen));
  if (!plane.ok()) return Fail(std::string(plane.status().message()));
  LogLine() << "logprob-server: " << plane->description;
  std::unique_ptr<logprob::WorkerLauncher> launcher;
  if (external > 0) {
    launcher = std::make_unique<logprob::ExternalLauncher>(external);
  } else {
    std::string worker_binary = absl::GetFlag(FLAGS_worker_binary);
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
  logprob::Metrics metrics(absl::GetFlag(FLAGS_backend));
  if (!absl::GetFlag(FLAGS_metrics_listen).empty()) {
    try {
      metrics.Expose(absl::GetFlag(FLAGS_metrics_listen));
    } catch (const std::exception& e) {
      return Fail("cannot listen on --metrics-listen " + logprob::ListenFailure(absl::GetFlag(FLAGS_metrics_listen)) +
                  " (" + e.what() + ")");
    }
  }

  logprob::ServiceConfig config;
  config.limits.max_tokens = absl::GetFlag(FLAGS_max_tokens_per_request);
  config.limits.max_topk = absl::GetFlag(FLAGS_max_topk);
  config.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  config.max_queue_tokens = absl::GetFlag(FLAGS_max_queue_tokens);
  config.max_queue_bytes = absl::GetFlag(FLAGS_max_queue_bytes);
  metrics.memory().SetBound(memory_bound.total());
  LogLine() << "logprob-server: memory bound " << memory_bound.Describe();
  const absl::Duration delay = absl::GetFlag(FLAGS_max_queue_delay);
  if (delay < absl::ZeroDuration() || delay > absl::Seconds(10)) return Fail("--max-queue-delay must be in [0, 10s]");
  config.max_queue_delay = absl::ToChronoMicroseconds(delay);
  config.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  config.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  config.shared_memory_inputs = absl::GetFlag(FLAGS_shared_memory_inputs);
  config.cuda_ipc_inputs = absl::GetFlag(FLAGS_cuda_ipc_inputs);
  config.shared_memory_regions.max_bytes = absl::GetFlag(FLAGS_max_shared_memory_bytes);
  config.shared_memory_regions.max_regions = absl::GetFlag(FLAGS_max_shared_memory_regions);
  const absl::Duration idle = absl::GetFlag(FLAGS_shared_memory_idle_timeout);
  if (idle < absl::Milliseconds(10)) return Fail("--shared-memory-idle-timeout must be >= 10ms");
  config.shared_memory_regions.idle_timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(idle));
  if (config.max_batch_tokens < 1) return Fail("--max-batch-tokens must be >= 1");
  config.parallelism = *parallelism;
  config.parallelism_name = absl::GetFlag(FLAGS_parallelism);
  config.backend = absl::GetFlag(FLAGS_backend);
  config.comm = absl::GetFlag(FLAGS_comm);
  if (config.max_request_bytes <= 0 || config.max_request_bytes > INT_MAX)
    return Fail("--max-request-bytes must be in (0, 2^31)");

  const int64_t chunk_tokens = absl::GetFlag(FLAGS_hidden_chunk_tokens);
  if (chunk_tokens < 1) return Fail("--hidden-chunk-tokens must be >= 1");
  logprob::internal::v1::JoinReply worker_config;
  worker_config.set_hidden_chunk_tokens(chunk_tokens);
  worker_config.set_backend(absl::GetFlag(FLAGS_backend));
  worker_config.set_comm(absl::GetFlag(FLAGS_comm));
  worker_config.set_lm_head_precision(logprob::LmHeadPrecisionName(*precision));
  int threads = absl::GetFlag(FLAGS_worker_threads);
  // External workers run on other machines: 0 lets each use its own cores.
  if (threads <= 0 && external == 0)
    threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / workers);
  threads = std::max(threads, 0);
  worker_config.set_threads(threads);
  // The only shared-memory objects the workers open for payloads: this process's regions.
  if (memory_limits.payload_regions) worker_config.set_payload_region_prefix(logprob::OwnRegionPrefix());
  config.hidden_chunk_tokens = chunk_tokens;
  const auto precision_of = [p = *precision](logprob::DType dtype) {
    return logprob::LmHeadPrecisionName(logprob::ResolveLmHeadPrecision(p, dtype));
  };
  config.lm_head_precision = precision_of;

  // Named lm_heads: --lm-head [NAME=]PATH[:TENSOR], repeatable.
  const int retain = absl::GetFlag(FLAGS_lm_head_retain);
  if (retain < 1) return Fail("--lm-head-retain must be >= 1");
  const std::string initial_version = absl::GetFlag(FLAGS_lm_head_version);
  if (auto st = logprob::CheckLmHeadVersionName(initial_version, "--lm-head-version"); !st.ok())
    return Fail(std::string(st.message()));
  auto releases = std::make_shared<logprob::LmHeadReleases>();
  logprob::LmHeads::Options heads_options;
  heads_options.retain = retain;
  heads_options.precision_of = precision_of;
  heads_options.on_release = [releases](const logprob::LmHeadVersion& v) { releases->Push(v); };
  for (const std::string& name : logprob::FlagValues(argc, argv, "lm_head_frozen")) {
    if (auto st = logprob::CheckLmHeadName(name, "--lm-head-frozen"); !st.ok()) return Fail(std::string(st.message()));
    heads_options.frozen.insert(name);
  }
  logprob::LmHeads heads(heads_options);
  // --lm-head-logit-scale / --lm-head-softcap: "" when not given.
  logprob::LmHeadScalarFlags scalar_flags;
  auto scalar_flag = [](const char* flag, const std::string& value, bool zero_ok,
                        std::optional<double>* out) -> absl::Status {
    if (value.empty()) return absl::OkStatus();
    double d = 0;
    if (!absl::SimpleAtod(value, &d) || !std::isfinite(d) || d < 0 || (d == 0 && !zero_ok))
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " ", value, ": a number ", zero_ok ? ">= 0 (0: none)" : "> 0", " is needed"));
    *out = d;
    return zero_ok ? logprob::CheckSoftcap(d, flag) : logprob::CheckLogitScale(d, flag);
  };
  for (const absl::Status& st :
       {scalar_flag("--lm-head-logit-scale", absl::GetFlag(FLAGS_lm_head_logit_scale), false,
                    &scalar_flags.logit_scale),
        scalar_flag("--lm-head-softcap", absl::GetFlag(FLAGS_lm_head_softcap), true, &scalar_flags.softcap)})
    if (!st.ok()) return Fail(std::string(st.message()));
  if ((scalar_flags.logit_scale || scalar_flags.softcap) && lm_head_args.empty())
    return Fail("--lm-head-logit-scale / --lm-head-softcap apply to an --lm-head; none is given");
  for (const std::string& arg : lm_head_args) {
    auto head = LoadStartupHead(arg, initial_version, workers, scalar_flags, *precision,
                                /*device=*/absl::GetFlag(FLAGS_backend) == "cuda");
    if (!head.ok()) return Fail("--lm-head " + arg + ": " + std::string(head.status().message()));
    const std::string name = head->head;
    if (auto st = heads.Add(*std::move(head)); !st.ok()) return Fail(std::string(st.message()));
  }
  for (const std::string& arg : logprob::FlagValues(argc, argv, "lm_head_declare")) {
    auto declared = logprob::ParseDeclaredLmHead(arg, workers);
    if (!declared.ok()) return Fail(std::string(declared.status().message()));
    if (!absl::GetFlag(FLAGS_allow_lm_head_updates))
      return Fail("--lm-head-declare " + arg + ": a declared head is filled by an update; add --allow-lm-head-updates");
    if (auto st = heads.Declare(*std::move(declared)); !st.ok())
      return Fail("--lm-head-declare " + arg + ": " + std::string(st.message()));
    LogLine() << "logprob-server: lm_head declared " << arg << " (not servable until an update fills it)";
  }
  for (const std::string& name : heads_options.frozen)
    if (heads.Find(name, initial_version) == nullptr)
      return Fail("--lm-head-frozen " + name + ": no --lm-head of that name");
  config.lm_heads = &heads;
  config.lm_head_updates = absl::GetFlag(FLAGS_allow_lm_head_updates);
  absl::StatusOr<std::unique_ptr<logprob::StoreFolder>> store_folder =
      MakeStoreFolder(absl::GetFlag(FLAGS_lm_head_store_dir));
  if (!store_folder.ok()) return Fail("--lm-head-store-dir: " + std::string(store_folder.status().message()));
  config.lm_head_store_bytes = [dir = (*store_folder)->path()] { return logprob::LmHeadStore::BytesOf(dir); };
  if (config.lm_head_updates && heads.empty()) return Fail("--allow-lm-head-updates needs an --lm-head to update");
  // A replica catching up with its peers serves no hidden-states request
  // (UNAVAILABLE) and reports NOT_SERVING until it holds their versions.
  const std::string sync_from = absl::GetFlag(FLAGS_lm_head_sync_from);
  if (!sync_from.empty() && !config.lm_head_updates)
    return Fail("--lm-head-sync-from needs --allow-lm-head-updates (caught-up versions go through the update path)");
  if (!sync_from.empty() && external > 0)
    return Fail(
        "--lm-head-sync-from is for replicated front-ends with local workers (--workers); a cluster-mode "
        "front-end is the only one of its group");
  std::atomic<bool> heads_synced{sync_from.empty()};
  config.lm_heads_ready = [&heads_synced]() -> absl::Status {
    if (heads_synced) return absl::OkStatus();
    return absl::UnavailableError(
        "this front-end is catching up with its peers' lm_head versions (--lm-head-sync-from); try another replica");
  };

  // Security of the public port. The control plane and the workers' ports
  // carry no TLS: loopback by default, a private network in cluster mode.
  auto credentials = logprob::ServerCredentialsFromFiles(absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                                                         absl::GetFlag(FLAGS_tls_client_ca));
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  std::optional<logprob::BearerTokenAuth> auth;
  if (const std::string file = absl::GetFlag(FLAGS_auth_token_file); !file.empty()) {
    auto loaded = logprob::BearerTokenAuth::FromFile(file);
    if (!loaded.ok()) return Fail("--auth-token-file " + std::string(loaded.status().message()));
    auth = *std::move(loaded);
  }
  std::optional<logprob::BearerTokenAuth> update_auth;
  if (const std::string file = absl::GetFlag(FLAGS_update_token_file); !file.empty()) {
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
  pool_opts.lm_heads = [&heads] { return heads.Alive(); };
  // Workers that cannot read a head's file (another node) fetch its rows
  // from here: the files of live versions and of the update store only.
  pool_opts.lm_head_files = [&heads, store = lm_head_store_dir](const std::string& file) {
    return logprob::InLmHeadStore(file, store) || logprob::IsLiveLmHeadFile(file, heads.Alive());
  };
  pool_opts.workers = workers;
  pool_opts.auth = plane->auth;
  pool_opts.control_listen = absl::GetFlag(FLAGS_control_listen);
  pool_opts.join_timeout = std::chrono::seconds(absl::GetFlag(FLAGS_worker_join_timeout));
  std::atomic<grpc::Server*> public_server{nullptr};
  // Health: SERVING while the pool is up and the heads caught up with the peers.
  std::mutex health_mu;
  bool pool_up = false;
  const auto publish_health = [&] {
    std::lock_guard<std::mutex> lock(health_mu);
    if (grpc::Server* s = public_server.load(); s && !g_stop)
      s->GetHealthCheckService()->SetServingStatus(pool_up && heads_synced);
  };
  pool_opts.on_serving = [&](bool up) {
    {
      std::lock_guard<std::mutex> lock(health_mu);
      pool_up = up;
    }
    publish_health();
    metrics.SetWorkersUp(up ? workers : 0);
  };
  pool_opts.on_restart = [&] { metrics.AddWorkerRestart(); };
  pool_opts.join_observers.on_waiting = [&](int waiting) { metrics.SetWorkersWaiting(waiting); };
  pool_opts.join_observers.on_refused = [&] { metrics.AddJoinRefused(); };
  logprob::WorkerPool pool(pool_opts, std::move(launcher));

  // lm_head updates: staged in the store directory, loaded by every worker, then committed.
  logprob::LmHeadUpdates::Options update_options;
  update_options.allowed = config.lm_head_updates;
  update_options.update_dir = absl::GetFlag(FLAGS_lm_head_update_dir);
  update_options.store_dir = lm_head_store_dir;
  update_options.timeout = absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_lm_head_update_timeout));
  update_options.memory_bytes = absl::GetFlag(FLAGS_lm_head_memory_bytes);
  update_options.store_files_per_head = logprob::LmHeadStoreFiles(retain);
  logprob::LmHeadWorkers update_workers;
  update_workers.load = [&pool](const logprob::internal::v1::LmHeadLoad& load) { return pool.LoadLmHead(load); };
  update_workers.serving = [&pool](int64_t generation) { return pool.Serving(generation); };
  update_workers.drop = [&pool](const logprob::internal::v1::LmHeadRef& ref) { return pool.DropLmHead(ref); };
  // Rows sent as a CUDA IPC handle (accepted only where CUDA IPC inputs are
  // offered: ScoringCore::ResolveTensor) are copied by a worker on this host.
  update_workers.stage = [&pool](const logprob::internal::v1::LmHeadStage& stage) {
    return pool.StageLmHeadRows(stage);
  };
  logprob::LmHeadUpdateObservers update_observers;
  const auto publish_heads = [&metrics, &heads] {
    for (const auto& h : heads.List())
      if (!h.version().empty())  // a declared head gets its series with its first version
        metrics.SetLmHead(h.name(), h.version(), h.bytes_per_worker() * h.retained_versions_size());
  };
  publish_heads();
  update_observers.on_end = [&metrics, publish_heads](const std::string& head, const std::string& outcome,
                                                      double seconds, int64_t) {
    metrics.ObserveLmHeadUpdate(head, outcome, seconds);
    if (outcome == "committed") publish_heads();
  };
  update_observers.on_bytes = [&metrics](const std::string& head, int64_t bytes) {
    metrics.AddLmHeadUpdateBytes(head, bytes);
  };
  update_observers.on_store_bytes = [&metrics](int64_t bytes) { metrics.SetLmHeadStoreBytes(bytes); };
  logprob::LmHeadUpdates updates(update_options, &heads, releases, update_workers, update_observers);
  logprob::ScoringService service(
      pool, config, &metrics, &updates,
      logprob::AccessPolicy(auth ? &*auth : nullptr, update_auth ? &*update_auth : nullptr));

  // Serve health (NOT_SERVING until the pool is up) while workers start.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  logprob::ExclusivePorts(builder);  // a second server on this port fails instead of sharing it
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), *credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_request_bytes));
  builder.SetMaxSendMessageSize(INT_MAX);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  if (!server || port == 0)
    return Fail("cannot listen on --listen " + logprob::ListenFailure(absl::GetFlag(FLAGS_listen)));
  server->GetHealthCheckService()->SetServingStatus(false);
  public_server = server.get();
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);

  LogLine() << "logprob-server: listening on " << absl::GetFlag(FLAGS_listen)
            << (absl::GetFlag(FLAGS_tls_cert).empty()        ? " (plaintext)"
                : absl::GetFlag(FLAGS_tls_client_ca).empty() ? " (TLS)"
                                                             : " (mutual TLS)")
            << (auth ? " with bearer-token auth" : "") << (update_auth ? " and an update token" : "") << ", "
            << (external > 0 ? "waiting for " : "starting ") << workers << (external > 0 ? " external" : "")
            << " worker(s)";
  if (auto st = pool.Start(); !st.ok()) {
    server->Shutdown();
    return Fail("worker pool: " + std::string(st.message()));
  }
  if (!sync_from.empty()) {
    logprob::client::ChannelOptions peer_channel;
    peer_channel.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
    peer_channel.tls_ca = absl::GetFlag(FLAGS_lm_head_sync_tls_ca);
    if (!peer_channel.tls_ca.empty()) {
      peer_channel.tls_cert = absl::GetFlag(FLAGS_tls_cert);
      peer_channel.tls_key = absl::GetFlag(FLAGS_tls_key);
      peer_channel.tls_server_name = absl::GetFlag(FLAGS_lm_head_sync_tls_server_name);
    }
    logprob::PeerSyncOptions sync;
    sync.target = sync_from;
    sync.channel = [peer_channel](const std::string& address) {
      return logprob::client::MakeChannel(address, peer_channel);
    };
    sync.pull_timeout = std::chrono::seconds(absl::ToInt64Seconds(absl::GetFlag(FLAGS_lm_head_sync_timeout)));
    auto synced = logprob::SyncLmHeadsFromPeers(sync, heads, updates);
    if (!synced.ok()) {
      server->Shutdown();
      return Fail("--lm-head-sync-from " + sync_from + ": " + std::string(synced.status().message()));
    }
    heads_synced = true;
    publish_health();
    LogLine() << "logprob-server: lm_heads caught up with the peers (" << synced->size() << " head(s) checked)";
  }
  if (external == 0) LogLine() << "logprob-server: " << workers << " worker(s) joined; SERVING";

  // Once a second, freed memory over --keep-freed-memory-bytes goes back
  // to the OS: the trims around large requests miss what is freed after
  // the last one (its answer's buffers, released once sent), which would
  // stay until the next large request.
  for (int tick = 1; !g_stop; ++tick) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (tick % 10 == 0) logprob::TrimKeptFreedMemory();
  }
  // Drain: NOT_SERVING first, then refuse new calls and give the ones in
  // flight --shutdown-grace seconds before cancelling them.
  const int grace = absl::GetFlag(FLAGS_shutdown_grace);
  LogLine() << "logprob-server: SIGTERM: NOT_SERVING, draining for up to " << grace << " s";
  pool.Drain();  // a worker that leaves now fails its calls but starts no new pool
  server->GetHealthCheckService()->SetServingStatus(false);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(grace));
  LogLine() << "logprob-server: drained; stopping workers";
  return 0;
}
