// logprob-server's command line: the flags (defined once, in
// server_flags.cc), read into one ServerFlags and checked in two steps.
// The first step (CheckPoolFlags) is all --print-memory-bound needs; the
// second (CheckServingFlags) every other pure flag check, so that main
// only wires checked values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/lm_head_cpu_kernel.h"
#include "common/lm_head_precision.h"
#include "common/lm_head_source.h"
#include "logprob/internal/v1/worker.pb.h"
#include "server/core/planner.h"
#include "server/core/scoring_core.h"
#include "server/inputs/input_resolver.h"

namespace logprob {

/// The values of logprob-server's flags (each field the flag of its name,
/// dashes as underscores) and what the checks derive from them.
struct ServerFlags {
  std::string listen;
  int workers = 1;
  int external_workers = 0;
  bool workers_given = false;  // --workers is on the command line
  std::string backend, comm, parallelism_name;
  std::vector<std::string> lm_heads;                 // every --lm-head, in order
  std::vector<std::string> lm_head_declares;         // every --lm-head-declare, in order
  std::vector<std::string> lm_head_frozen;           // every --lm-head-frozen, in order
  std::string lm_head_logit_scale, lm_head_softcap;  // "" when not given
  std::string lm_head_version;
  int lm_head_retain = 1;
  bool allow_lm_head_updates = false;
  std::string lm_head_update_dir, lm_head_store_dir;
  absl::Duration lm_head_update_timeout;
  std::string lm_head_sync_from;
  absl::Duration lm_head_sync_timeout;
  std::string lm_head_sync_tls_ca, lm_head_sync_tls_server_name;
  int64_t lm_head_memory_bytes = 0;
  int64_t hidden_chunk_tokens = 0;
  int64_t max_gradient_step_bytes = 0;  // per worker (docs/gradients.md)
  absl::Duration gradient_step_timeout;
  std::string lm_head_precision_name;
  std::string lm_head_cpu_kernel_name;
  int worker_threads = 0;
  std::string metrics_listen, control_listen, internal_secret_file;
  bool insecure_internal_plane = false;
  std::string worker_binary;
  int64_t max_request_bytes = 0;
  int64_t keep_freed_memory_bytes = 0;  // -1 resolved by CheckPoolFlags
  bool print_memory_bound = false;
  int64_t max_tokens_per_request = 0;
  int max_topk = 0;
  int worker_join_timeout = 0;
  int shutdown_grace = 0;
  int64_t max_queue_tokens = 0, max_queue_bytes = 0;
  absl::Duration max_queue_delay;
  int64_t max_batch_tokens = 0;
  bool shared_memory = true, shared_memory_inputs = true, cuda_ipc_inputs = true;
  int64_t max_shared_memory_bytes = 0;
  int max_shared_memory_regions = 0;
  absl::Duration shared_memory_idle_timeout;
  std::string tls_cert, tls_key, tls_client_ca, auth_token_file, update_token_file;

  // Set by CheckPoolFlags:
  int pool_workers = 0;  // the pool's size: --external-workers, else --workers
  // Set by CheckServingFlags:
  Parallelism parallelism = Parallelism::kAuto;
  LmHeadPrecision lm_head_precision = LmHeadPrecision::kAuto;
  LmHeadCpuKernel lm_head_cpu_kernel = LmHeadCpuKernel::kAuto;
  LmHeadScalarFlags lm_head_scalars;  // --lm-head-logit-scale / --lm-head-softcap

  /// Cluster mode: the workers are started elsewhere (--external-workers).
  bool cluster() const { return external_workers > 0; }
};

/// Sets the usage message and --version text, parses the command line
/// (Abseil: exits on an unknown flag, --help, --version) and returns the
/// flags' values, unchecked. Call once.
ServerFlags ParseServerFlags(int argc, char** argv);

/// The checks needed before anything else: --keep-freed-memory-bytes
/// (its -1 resolved to --max-request-bytes), cluster mode
/// (CheckClusterFlags) and the pool's size (sets `pool_workers`).
/// INVALID_ARGUMENT with the message to print.
absl::Status CheckPoolFlags(ServerFlags& flags);

/// Checks every other flag that needs no file or process (backend and
/// communicator, parallelism, precision, queue and batch limits, the
/// lm_head flags' values and combinations) and sets the parsed fields.
/// Call after CheckPoolFlags. The first error's message, as printed.
absl::Status CheckServingFlags(ServerFlags& flags);

/// Checks the flags of cluster mode (--external-workers N): exclusive with
/// --workers, and a --control-listen the workers can find (fixed port);
/// logs a loopback --control-listen.
absl::Status CheckClusterFlags(int external, bool workers_given, const std::string& control_listen);

/// The scoring core's configuration from checked flags, without the
/// lm_heads and their callbacks (the wiring sets those).
ServiceConfig ServiceConfigFromFlags(const ServerFlags& flags);

/// The input resolver's options (--shared-memory-inputs and its caps,
/// --cuda-ipc-inputs) for a pool of `workers` workers, `same_host` when
/// this server started them on its host.
InputResolverOptions InputResolverOptionsFromFlags(const ServerFlags& flags, int workers, bool same_host);

/// What every worker is told at its join from checked flags;
/// `payload_regions`: workers open this process's payload regions.
internal::v1::JoinReply WorkerConfigFromFlags(const ServerFlags& flags, bool payload_regions);

}  // namespace logprob
