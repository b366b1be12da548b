// Prometheus metrics of the front-end (prometheus-cpp), named in base
// units: *_total counters, *_seconds durations, *_bytes sizes.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/metrics/memory_metrics.h"

namespace logprob {

/// The service's metrics; Expose() serves them over HTTP at /metrics.
class Metrics {
 public:
  /// `backend`: the workers' compute backend, the build_info label.
  explicit Metrics(const std::string& backend = "cpu");
  /// Starts the HTTP exposer on `listen` (host:port). Throws on bind errors
  /// (prometheus-cpp / civetweb).
  void Expose(const std::string& listen);

  /// The memory gauges read at scrape time (pools register there).
  MemoryMetrics& memory() { return *memory_; }

  /// Records one finished request of `method` with gRPC status `code` name.
  void ObserveRequest(const std::string& method, const std::string& code, double seconds, int64_t tokens);
  /// Records the serialized size of one received request of `method`
  /// (every request that reaches validation, whatever its outcome).
  void ObserveRequestBytes(const std::string& method, int64_t bytes);
  /// Sets the admitted, not yet answered load: `requests` requests with
  /// `tokens` token rows and `bytes` request bytes, those of requests
  /// still arriving included (Admission's observer).
  void SetLoad(int64_t requests, int64_t tokens, int64_t bytes);
  /// One successful worker batch (server/core/batcher.h), of `requests`
  /// requests and `rows` token rows.
  struct BatchStats {
    double run_seconds = 0;         // wall time of WorkerPool::Run
    double compute_seconds = 0;     // slowest worker's WorkResult.compute_seconds
    double collective_seconds = 0;  // slowest worker's WorkResult.collective_seconds
    int64_t rows = 0;
    int requests = 1;
  };
  /// Records one successful worker batch.
  void ObserveBatch(const BatchStats& batch);
  /// Records how long one request waited in the batching queue.
  void ObserveQueue(double seconds);
  /// Sets the requests waiting in the batching queue.
  void SetQueued(int64_t requests);
  /// Sets the worker batches handed to the pool (WorkerPool::Run) and not
  /// yet finished; vocab-parallel and hidden-states ones may wait there
  /// for each other's collectives.
  void SetRunningBatches(int64_t batches);
  /// Sets the workers that joined the control plane and wait for the pool
  /// to have all its workers.
  void SetWorkersWaiting(int n);
  /// Counts one join refused because the pool already had its workers.
  void AddJoinRefused();
  /// Sets the GPU memory in use by worker `worker` (CUDA backend).
  void SetGpuMemory(int worker, int64_t bytes);
  /// Sets the clients' registered shared-memory regions and their bytes.
  void SetSharedMemory(int64_t regions, int64_t bytes);
  /// Sets the number of worker processes that joined the pool.
  void SetWorkersUp(int n);
  /// Counts one re-formed worker pool generation.
  void AddWorkerRestart();
  /// Sets lm_head `head`'s current version (logprob_lm_head_info) and the
  /// bytes per worker of its retained versions. Thread-safe.
  void SetLmHead(const std::string& head, const std::string& version, int64_t retained_bytes)
      ABSL_LOCKS_EXCLUDED(lm_head_mu_);
  /// Records one ended lm_head update: `outcome` (committed, aborted,
  /// timeout, worker_error, sha256_mismatch) and its duration.
  void ObserveLmHeadUpdate(const std::string& head, const std::string& outcome, double seconds);
  /// Counts bytes of lm_head rows received for `head`.
  void AddLmHeadUpdateBytes(const std::string& head, int64_t bytes);
  /// Sets the bytes the lm_head store's files take (logprob_lm_head_store_bytes).
  void SetLmHeadStoreBytes(int64_t bytes);
  /// One request's rollout mismatch (docs/SPEC.md "Rollout mismatch"), by
  /// lm_head `head` (empty for a logits request; no version label):
  /// `log_ratios` are its compared tokens' l = logp - logp_rollout (finite
  /// ones into the histogram logprob_rollout_log_ratio, +-inf counted by
  /// logprob_rollout_infinite_log_ratios_total), `outside_band` of them left
  /// the request's band, and `k3` (the request's mean, observed in
  /// logprob_rollout_request_k3 when finite and log_ratios is not empty).
  /// Thread-safe.
  void ObserveRolloutMismatch(const std::string& head, const std::vector<float>& log_ratios, int64_t outside_band,
                              double k3);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<MemoryMetrics> memory_ = std::make_shared<MemoryMetrics>();
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Counter& tokens_;
  prometheus::Gauge& workers_up_;
  prometheus::Counter& worker_restarts_;
  prometheus::Family<prometheus::Histogram>& request_bytes_;
  prometheus::Gauge& inflight_requests_;
  prometheus::Gauge& queued_tokens_;
  prometheus::Gauge& queued_bytes_;
  prometheus::Histogram& compute_duration_;
  prometheus::Histogram& worker_call_duration_;
  prometheus::Histogram& batch_tokens_;
  prometheus::Histogram& batch_requests_;
  prometheus::Histogram& queue_duration_;
  prometheus::Histogram& collective_duration_;
  prometheus::Gauge& queued_requests_;
  prometheus::Gauge& running_batches_;
  prometheus::Gauge& workers_waiting_;
  prometheus::Counter& joins_refused_;
  prometheus::Family<prometheus::Gauge>& gpu_memory_;
  prometheus::Gauge& shm_regions_;
  prometheus::Gauge& shm_bytes_;
  prometheus::Family<prometheus::Gauge>& lm_head_info_;
  prometheus::Family<prometheus::Gauge>& lm_head_retained_bytes_;
  prometheus::Family<prometheus::Counter>& lm_head_updates_;
  prometheus::Family<prometheus::Histogram>& lm_head_update_duration_;
  prometheus::Family<prometheus::Counter>& lm_head_update_bytes_;
  prometheus::Gauge& lm_head_store_bytes_;
  prometheus::Family<prometheus::Histogram>& rollout_log_ratio_;
  prometheus::Family<prometheus::Histogram>& rollout_request_k3_;
  prometheus::Family<prometheus::Counter>& rollout_tokens_;
  prometheus::Family<prometheus::Counter>& rollout_outside_band_;
  prometheus::Family<prometheus::Counter>& rollout_infinite_;
  absl::Mutex lm_head_mu_;
  std::map<std::string, prometheus::Gauge*> lm_head_info_now_ ABSL_GUARDED_BY(lm_head_mu_);  // head -> its info gauge
};

}  // namespace logprob
