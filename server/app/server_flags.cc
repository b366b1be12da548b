// logprob-server's flags (the only place they are defined) and their
// checks: server_flags.h.
#include "server/app/server_flags.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/backend_choice.h"
#include "common/flag_names.h"
#include "common/lm_head_transform.h"
#include "common/log_line.h"
#include "common/loopback.h"
#include "common/shared_memory.h"
#include "common/version.h"
#include "server/heads/lm_heads.h"

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
ABSL_FLAG(int64_t, max_gradient_step_bytes, int64_t{2} << 30,
          "per worker cap on the bytes of the lm_head gradient sums of open optimizer steps (each step holds "
          "its slice's [V / workers, H] floats, docs/gradients.md); a backward opening a step over it is refused");
ABSL_FLAG(absl::Duration, gradient_step_timeout, absl::Minutes(10),
          "an open gradient step no backward or read used for this long is dropped (its sums lost)");
ABSL_FLAG(std::string, lm_head_precision, "auto",
          "operands of the lm_head GEMM (f32 accumulation and logits in every case): auto (bf16 for BF16 "
          "weights, fp32 for F32 / F16 weights), bf16 (weights and hidden states rounded to bf16), tf32 (GPU: "
          "TF32 tensor cores; CPU: both operands rounded to tf32, f32 GEMM) or fp32 (exact f32 operands, e.g. for "
          "a rollout engine computing the head in fp32)");
ABSL_FLAG(std::string, lm_head_cpu_kernel, "auto",
          "CPU workers' kernel for the bf16 lm_head GEMM (the same products and f32 accumulation, other summation "
          "order): auto (chosen once for the pool: widen without a bf16 matmul, bf16 with AMX, else the faster "
          "of the two measured on the head's shape at start-up), bf16 (oneDNN's bf16 x bf16 matmul) or widen "
          "(operands widened exactly to f32, oneDNN's f32 matmul); replicas that must give the same bits set it");
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

namespace logprob {

ServerFlags ParseServerFlags(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "logprob-server --listen HOST:PORT (--workers N | --external-workers N --control-listen HOST:PORT) "
      "[--backend cpu|cuda] [--comm gloo|nccl] [--lm-head FILE[:TENSOR] [--lm-head-precision auto|bf16|tf32|fp32]] "
      "[--metrics-listen HOST:PORT] "
      "[--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--auth-token-file FILE] [--update-token-file FILE]");
  // --version: the release and whether the build has CUDA (common/version.h).
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return VersionText("logprob-server"); };
  absl::SetFlagsUsageConfig(usage_config);
  NormalizeFlagDashes(argc, argv);
  ServerFlags f;
  // Repeatable flags: every value (Abseil keeps only the last).
  f.lm_heads = FlagValues(argc, argv, "lm_head");
  f.lm_head_declares = FlagValues(argc, argv, "lm_head_declare");
  f.lm_head_frozen = FlagValues(argc, argv, "lm_head_frozen");
  f.workers_given = FlagGiven(argc, argv, "workers");
  absl::ParseCommandLine(argc, argv);
  f.listen = absl::GetFlag(FLAGS_listen);
  f.workers = absl::GetFlag(FLAGS_workers);
  f.external_workers = absl::GetFlag(FLAGS_external_workers);
  f.backend = absl::GetFlag(FLAGS_backend);
  f.comm = absl::GetFlag(FLAGS_comm);
  f.parallelism_name = absl::GetFlag(FLAGS_parallelism);
  f.lm_head_logit_scale = absl::GetFlag(FLAGS_lm_head_logit_scale);
  f.lm_head_softcap = absl::GetFlag(FLAGS_lm_head_softcap);
  f.lm_head_version = absl::GetFlag(FLAGS_lm_head_version);
  f.lm_head_retain = absl::GetFlag(FLAGS_lm_head_retain);
  f.allow_lm_head_updates = absl::GetFlag(FLAGS_allow_lm_head_updates);
  f.lm_head_update_dir = absl::GetFlag(FLAGS_lm_head_update_dir);
  f.lm_head_store_dir = absl::GetFlag(FLAGS_lm_head_store_dir);
  f.lm_head_update_timeout = absl::GetFlag(FLAGS_lm_head_update_timeout);
  f.lm_head_sync_from = absl::GetFlag(FLAGS_lm_head_sync_from);
  f.lm_head_sync_timeout = absl::GetFlag(FLAGS_lm_head_sync_timeout);
  f.lm_head_sync_tls_ca = absl::GetFlag(FLAGS_lm_head_sync_tls_ca);
  f.lm_head_sync_tls_server_name = absl::GetFlag(FLAGS_lm_head_sync_tls_server_name);
  f.lm_head_memory_bytes = absl::GetFlag(FLAGS_lm_head_memory_bytes);
  f.hidden_chunk_tokens = absl::GetFlag(FLAGS_hidden_chunk_tokens);
  f.max_gradient_step_bytes = absl::GetFlag(FLAGS_max_gradient_step_bytes);
  f.gradient_step_timeout = absl::GetFlag(FLAGS_gradient_step_timeout);
  f.lm_head_precision_name = absl::GetFlag(FLAGS_lm_head_precision);
  f.lm_head_cpu_kernel_name = absl::GetFlag(FLAGS_lm_head_cpu_kernel);
  f.worker_threads = absl::GetFlag(FLAGS_worker_threads);
  f.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  f.control_listen = absl::GetFlag(FLAGS_control_listen);
  f.internal_secret_file = absl::GetFlag(FLAGS_internal_secret_file);
  f.insecure_internal_plane = absl::GetFlag(FLAGS_insecure_internal_plane);
  f.worker_binary = absl::GetFlag(FLAGS_worker_binary);
  f.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  f.keep_freed_memory_bytes = absl::GetFlag(FLAGS_keep_freed_memory_bytes);
  f.print_memory_bound = absl::GetFlag(FLAGS_print_memory_bound);
  f.max_tokens_per_request = absl::GetFlag(FLAGS_max_tokens_per_request);
  f.max_topk = absl::GetFlag(FLAGS_max_topk);
  f.worker_join_timeout = absl::GetFlag(FLAGS_worker_join_timeout);
  f.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  f.max_queue_tokens = absl::GetFlag(FLAGS_max_queue_tokens);
  f.max_queue_bytes = absl::GetFlag(FLAGS_max_queue_bytes);
  f.max_queue_delay = absl::GetFlag(FLAGS_max_queue_delay);
  f.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  f.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  f.shared_memory_inputs = absl::GetFlag(FLAGS_shared_memory_inputs);
  f.cuda_ipc_inputs = absl::GetFlag(FLAGS_cuda_ipc_inputs);
  f.max_shared_memory_bytes = absl::GetFlag(FLAGS_max_shared_memory_bytes);
  f.max_shared_memory_regions = absl::GetFlag(FLAGS_max_shared_memory_regions);
  f.shared_memory_idle_timeout = absl::GetFlag(FLAGS_shared_memory_idle_timeout);
  f.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  f.tls_key = absl::GetFlag(FLAGS_tls_key);
  f.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  f.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  f.update_token_file = absl::GetFlag(FLAGS_update_token_file);
  return f;
}

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
  if (IsLoopbackHost(host))
    LogLine() << "logprob-server: --control-listen " << control_listen
              << " is loopback: only workers on this host can join (use 0.0.0.0:PORT for a cluster)";
  return absl::OkStatus();
}

absl::Status CheckPoolFlags(ServerFlags& f) {
  if (f.keep_freed_memory_bytes < -1)
    return absl::InvalidArgumentError("--keep-freed-memory-bytes must be >= 0, or -1 for --max-request-bytes");
  if (f.keep_freed_memory_bytes == -1) f.keep_freed_memory_bytes = f.max_request_bytes;
  if (auto st = CheckClusterFlags(f.external_workers, f.workers_given, f.control_listen); !st.ok()) return st;
  f.pool_workers = f.cluster() ? f.external_workers : f.workers;
  if (f.pool_workers < 1) return absl::InvalidArgumentError("--workers must be >= 1");
  return absl::OkStatus();
}

namespace {

/// Parses --lm-head-logit-scale (`zero_ok` false: > 0) or --lm-head-softcap
/// (`zero_ok`: >= 0) into `out`; "" (not given) leaves it unset.
absl::Status ParseScalarFlag(const char* flag, const std::string& value, bool zero_ok, std::optional<double>* out) {
  if (value.empty()) return absl::OkStatus();
  double d = 0;
  if (!absl::SimpleAtod(value, &d) || !std::isfinite(d) || d < 0 || (d == 0 && !zero_ok))
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " ", value, ": a number ", zero_ok ? ">= 0 (0: none)" : "> 0", " is needed"));
  *out = d;
  return zero_ok ? CheckSoftcap(d, flag) : CheckLogitScale(d, flag);
}

}  // namespace

absl::Status CheckServingFlags(ServerFlags& f) {
  if (auto st = CheckBackendChoice(f.backend, f.comm); !st.ok()) return st;
  absl::StatusOr<Parallelism> parallelism = ParseParallelism(f.parallelism_name);
  if (!parallelism.ok()) return parallelism.status();
  f.parallelism = *parallelism;
  absl::StatusOr<LmHeadPrecision> precision = ParseLmHeadPrecision(f.lm_head_precision_name);
  if (!precision.ok()) return precision.status();
  f.lm_head_precision = *precision;
  absl::StatusOr<LmHeadCpuKernel> cpu_kernel = ParseLmHeadCpuKernel(f.lm_head_cpu_kernel_name);
  if (!cpu_kernel.ok()) return cpu_kernel.status();
  f.lm_head_cpu_kernel = *cpu_kernel;
  const auto invalid = [](const char* msg) { return absl::InvalidArgumentError(msg); };
  if (f.max_queue_delay < absl::ZeroDuration() || f.max_queue_delay > absl::Seconds(10))
    return invalid("--max-queue-delay must be in [0, 10s]");
  if (f.shared_memory_idle_timeout < absl::Milliseconds(10))
    return invalid("--shared-memory-idle-timeout must be >= 10ms");
  if (f.max_batch_tokens < 1) return invalid("--max-batch-tokens must be >= 1");
  if (f.max_request_bytes <= 0 || f.max_request_bytes > INT_MAX)
    return invalid("--max-request-bytes must be in (0, 2^31)");
  if (f.hidden_chunk_tokens < 1) return invalid("--hidden-chunk-tokens must be >= 1");
  if (f.max_gradient_step_bytes < 0) return invalid("--max-gradient-step-bytes must be >= 0");
  if (f.gradient_step_timeout < absl::Seconds(1)) return invalid("--gradient-step-timeout must be >= 1s");
  if (f.lm_head_retain < 1) return invalid("--lm-head-retain must be >= 1");
  if (auto st = CheckLmHeadVersionName(f.lm_head_version, "--lm-head-version"); !st.ok()) return st;
  for (const std::string& name : f.lm_head_frozen)
    if (auto st = CheckLmHeadName(name, "--lm-head-frozen"); !st.ok()) return st;
  for (const absl::Status& st :
       {ParseScalarFlag("--lm-head-logit-scale", f.lm_head_logit_scale, false, &f.lm_head_scalars.logit_scale),
        ParseScalarFlag("--lm-head-softcap", f.lm_head_softcap, true, &f.lm_head_scalars.softcap)})
    if (!st.ok()) return st;
  if ((f.lm_head_scalars.logit_scale || f.lm_head_scalars.softcap) && f.lm_heads.empty())
    return invalid("--lm-head-logit-scale / --lm-head-softcap apply to an --lm-head; none is given");
  if (!f.lm_head_sync_from.empty() && !f.allow_lm_head_updates)
    return invalid("--lm-head-sync-from needs --allow-lm-head-updates (caught-up versions go through the update path)");
  if (!f.lm_head_sync_from.empty() && f.cluster())
    return invalid(
        "--lm-head-sync-from is for replicated front-ends with local workers (--workers); a cluster-mode "
        "front-end is the only one of its group");
  return absl::OkStatus();
}

InputResolverOptions InputResolverOptionsFromFlags(const ServerFlags& f, int workers, bool same_host) {
  InputResolverOptions o;
  o.shared_memory_inputs = f.shared_memory_inputs;
  o.shared_memory_regions.max_bytes = f.max_shared_memory_bytes;
  o.shared_memory_regions.max_regions = f.max_shared_memory_regions;
  o.shared_memory_regions.idle_timeout =
      std::chrono::milliseconds(absl::ToInt64Milliseconds(f.shared_memory_idle_timeout));
  o.cuda_ipc = CudaIpcAvailabilityOf(f.cuda_ipc_inputs, f.backend, f.comm, workers, same_host);
  return o;
}

ServiceConfig ServiceConfigFromFlags(const ServerFlags& f) {
  ServiceConfig config;
  config.limits.max_tokens = f.max_tokens_per_request;
  config.limits.max_topk = f.max_topk;
  config.max_request_bytes = f.max_request_bytes;
  config.max_queue_tokens = f.max_queue_tokens;
  config.max_queue_bytes = f.max_queue_bytes;
  config.max_queue_delay = absl::ToChronoMicroseconds(f.max_queue_delay);
  config.max_batch_tokens = f.max_batch_tokens;
  config.shared_memory = f.shared_memory;
  config.parallelism = f.parallelism;
  config.parallelism_name = f.parallelism_name;
  config.backend = f.backend;
  config.comm = f.comm;
  config.hidden_chunk_tokens = f.hidden_chunk_tokens;
  config.lm_head_precision = [p = f.lm_head_precision](DType dtype) {
    return LmHeadPrecisionName(ResolveLmHeadPrecision(p, dtype));
  };
  config.lm_head_updates = f.allow_lm_head_updates;
  return config;
}

internal::v1::JoinReply WorkerConfigFromFlags(const ServerFlags& f, bool payload_regions) {
  internal::v1::JoinReply worker_config;
  worker_config.set_hidden_chunk_tokens(f.hidden_chunk_tokens);
  worker_config.set_gradient_step_bytes(f.max_gradient_step_bytes);
  worker_config.set_gradient_step_timeout_seconds(absl::ToDoubleSeconds(f.gradient_step_timeout));
  worker_config.set_backend(f.backend);
  worker_config.set_comm(f.comm);
  worker_config.set_lm_head_precision(LmHeadPrecisionName(f.lm_head_precision));
  int threads = f.worker_threads;
  // External workers run on other machines: 0 lets each use its own cores.
  if (threads <= 0 && !f.cluster())
    threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / f.pool_workers);
  threads = std::max(threads, 0);
  worker_config.set_threads(threads);
  // The only shared-memory objects the workers open for payloads: this process's regions.
  if (payload_regions) worker_config.set_payload_region_prefix(OwnRegionPrefix());
  return worker_config;
}

}  // namespace logprob
