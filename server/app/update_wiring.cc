#include "server/app/update_wiring.h"

#include "server/app/memory_bound.h"

namespace logprob {

LmHeadUpdates::Options LmHeadUpdateOptionsFromFlags(const ServerFlags& flags, const std::string& store_dir) {
  LmHeadUpdates::Options options;
  options.allowed = flags.allow_lm_head_updates;
  options.update_dir = flags.lm_head_update_dir;
  options.store_dir = store_dir;
  options.timeout = absl::ToChronoMilliseconds(flags.lm_head_update_timeout);
  options.memory_bytes = flags.lm_head_memory_bytes;
  options.store_files_per_head = LmHeadStoreFiles(flags.lm_head_retain);
  return options;
}

LmHeadWorkers LmHeadWorkersOf(WorkerPool& pool) {
  LmHeadWorkers workers;
  workers.load = [&pool](const internal::v1::LmHeadLoad& load) { return pool.LoadLmHead(load); };
  workers.serving = [&pool](int64_t generation) { return pool.Serving(generation); };
  workers.drop = [&pool](const internal::v1::LmHeadRef& ref) { return pool.DropLmHead(ref); };
  // Rows sent as a CUDA IPC handle (accepted only where CUDA IPC inputs are
  // offered: InputResolver::ResolveTensor) are copied by a worker on this host.
  workers.stage = [&pool](const internal::v1::LmHeadStage& stage) { return pool.StageLmHeadRows(stage); };
  return workers;
}

void PublishLmHeads(Metrics& metrics, const LmHeads& heads) {
  for (const auto& h : heads.List())
    if (!h.version().empty())  // a declared head gets its series with its first version
      metrics.SetLmHead(h.name(), h.version(), h.bytes_per_worker() * h.retained_versions_size());
}

LmHeadUpdateObservers LmHeadUpdateObserversOf(Metrics& metrics, const LmHeads& heads) {
  LmHeadUpdateObservers observers;
  observers.on_end = [&metrics, &heads](const std::string& head, const std::string& outcome, double seconds, int64_t) {
    metrics.ObserveLmHeadUpdate(head, outcome, seconds);
    if (outcome == "committed") PublishLmHeads(metrics, heads);
  };
  observers.on_bytes = [&metrics](const std::string& head, int64_t bytes) {
    metrics.AddLmHeadUpdateBytes(head, bytes);
  };
  observers.on_store_bytes = [&metrics](int64_t bytes) { metrics.SetLmHeadStoreBytes(bytes); };
  return observers;
}

}  // namespace logprob
