#include "server/metrics/metrics.h"

#include <algorithm>
#include <cmath>

#include "common/version.h"
#include "prometheus/counter.h"

namespace logprob {

namespace {

/// Buckets of the duration histograms, seconds.
const prometheus::Histogram::BucketBoundaries& SecondsBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                                   0.5,   1,      2.5,   5,    10,    30,   60};
  return kBuckets;
}

/// Powers of 4 from 1 to 4^max_exp.
prometheus::Histogram::BucketBoundaries PowersOf4(int max_exp) {
  prometheus::Histogram::BucketBoundaries b;
  double v = 1;
  for (int i = 0; i <= max_exp; ++i, v *= 4) b.push_back(v);
  return b;
}

/// Buckets of l: 0 and +-{0.01, 0.02, 0.05, ..., 5} (|l| 0.1 is r ~ 0.9 or 1.1).
const prometheus::Histogram::BucketBoundaries& LogRatioBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = [] {
    const double mags[] = {0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5};
    prometheus::Histogram::BucketBoundaries b;
    for (int i = 8; i >= 0; --i) b.push_back(-mags[i]);
    b.push_back(0);
    for (double m : mags) b.push_back(m);
    return b;
  }();
  return kBuckets;
}

/// Buckets of a request's k3: 1e-5 .. 1 in steps of ~3.
const prometheus::Histogram::BucketBoundaries& K3Buckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3,
                                                                   1e-2, 3e-2, 0.1,  0.3,  1};
  return kBuckets;
}

}  // namespace

Metrics::Metrics(const std::string& backend)
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("logprob_requests_total")
                    .Help("Finished scoring requests by method and gRPC status code.")
                    .Register(*registry_)),
      duration_(prometheus::BuildHistogram()
                    .Name("logprob_request_duration_seconds")
                    .Help("Time from receiving a request to its answer.")
                    .Register(*registry_)),
      tokens_(prometheus::BuildCounter()
                  .Name("logprob_tokens_scored_total")
                  .Help("Token positions scored.")
                  .Register(*registry_)
                  .Add({})),
      workers_up_(prometheus::BuildGauge()
                      .Name("logprob_workers_up")
                      .Help("Worker processes that joined the pool.")
                      .Register(*registry_)
                      .Add({})),
      worker_restarts_(prometheus::BuildCounter()
                           .Name("logprob_worker_restarts_total")
                           .Help("Worker pool generations re-formed after a worker failed or hung.")
                           .Register(*registry_)
                           .Add({})),
      request_bytes_(prometheus::BuildHistogram()
                         .Name("logprob_request_bytes")
                         .Help("Serialized size of received scoring requests, bytes.")
                         .Register(*registry_)),
      inflight_requests_(prometheus::BuildGauge()
                             .Name("logprob_inflight_requests")
                             .Help("Scoring requests admitted and not yet answered.")
                             .Register(*registry_)
                             .Add({})),
      queued_tokens_(prometheus::BuildGauge()
                         .Name("logprob_queued_tokens")
                         .Help("Token rows of the requests admitted and not yet answered.")
                         .Register(*registry_)
                         .Add({})),
      queued_bytes_(prometheus::BuildGauge()
                        .Name("logprob_queued_bytes")
                        .Help("Request bytes counted against --max-queue-bytes: requests admitted and not yet "
                              "answered, and those still arriving (reserved before their body is read).")
                        .Register(*registry_)
                        .Add({})),
      compute_duration_(prometheus::BuildHistogram()
                            .Name("logprob_compute_duration_seconds")
                            .Help("Worker compute time per worker batch: the slowest worker's compute_seconds.")
                            .Register(*registry_)
                            .Add({}, SecondsBuckets())),
      worker_call_duration_(prometheus::BuildHistogram()
                                .Name("logprob_worker_call_duration_seconds")
                                .Help("Wall time of dispatching a worker batch to the workers and gathering "
                                      "their results (compute plus transfer and overhead).")
                                .Register(*registry_)
                                .Add({}, SecondsBuckets())),
      batch_tokens_(prometheus::BuildHistogram()
                        .Name("logprob_batch_tokens")
                        .Help("Token rows per worker batch.")
                        .Register(*registry_)
                        .Add({}, PowersOf4(12))),
      batch_requests_(prometheus::BuildHistogram()
                          .Name("logprob_batch_requests")
                          .Help("Requests packed into one worker batch (dynamic batching).")
                          .Register(*registry_)
                          .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128, 256})),
      queue_duration_(prometheus::BuildHistogram()
                          .Name("logprob_queue_duration_seconds")
                          .Help("Time a request waited in the batching queue before its batch started.")
                          .Register(*registry_)
                          .Add({}, SecondsBuckets())),
      collective_duration_(prometheus::BuildHistogram()
                               .Name("logprob_collective_duration_seconds")
                               .Help("Time per worker batch the slowest worker spent in collectives "
                                     "(all-gather, all-to-all).")
                               .Register(*registry_)
                               .Add({}, SecondsBuckets())),
      queued_requests_(prometheus::BuildGauge()
                           .Name("logprob_queued_requests")
                           .Help("Requests waiting in the batching queue.")
                           .Register(*registry_)
                           .Add({})),
      running_batches_(prometheus::BuildGauge()
                           .Name("logprob_running_batches")
                           .Help("Worker batches handed to the worker pool and not yet finished.")
                           .Register(*registry_)
                           .Add({})),
      workers_waiting_(prometheus::BuildGauge()
                           .Name("logprob_workers_waiting")
                           .Help("Workers that joined the control plane and wait for the pool to have all its "
                                 "workers.")
                           .Register(*registry_)
                           .Add({})),
      joins_refused_(prometheus::BuildCounter()
                         .Name("logprob_worker_joins_refused_total")
                         .Help("Worker joins refused because the pool already had its workers (a spare retries).")
                         .Register(*registry_)
                         .Add({})),
      gpu_memory_(prometheus::BuildGauge()
                      .Name("logprob_gpu_memory_bytes")
                      .Help("GPU memory in use by each worker (CUDA backend), as of its last batch.")
                      .Register(*registry_)),
      shm_regions_(prometheus::BuildGauge()
                       .Name("logprob_shared_memory_regions")
                       .Help("Shared-memory regions registered by clients (all sessions).")
                       .Register(*registry_)
                       .Add({})),
      shm_bytes_(prometheus::BuildGauge()
                     .Name("logprob_shared_memory_bytes")
                     .Help("byte_size of the shared-memory regions registered by clients (all sessions).")
                     .Register(*registry_)
                     .Add({})),
      lm_head_info_(prometheus::BuildGauge()
                        .Name("logprob_lm_head_info")
                        .Help("The current version of each lm_head; the value is 1.")
                        .Register(*registry_)),
      lm_head_retained_bytes_(prometheus::BuildGauge()
                                  .Name("logprob_lm_head_retained_bytes")
                                  .Help("Bytes per worker of each lm_head's retained versions.")
                                  .Register(*registry_)),
      lm_head_updates_(prometheus::BuildCounter()
                           .Name("logprob_lm_head_updates_total")
                           .Help("lm_head updates that ended, by head and outcome (committed, aborted, timeout, "
                                 "worker_error, sha256_mismatch).")
                           .Register(*registry_)),
      lm_head_update_duration_(prometheus::BuildHistogram()
                                   .Name("logprob_lm_head_update_duration_seconds")
                                   .Help("Time from BeginLmHeadUpdate to the update's end, by head.")
                                   .Register(*registry_)),
      lm_head_update_bytes_(prometheus::BuildCounter()
                                .Name("logprob_lm_head_update_bytes_total")
                                .Help("Bytes of lm_head rows received by updates, by head.")
                                .Register(*registry_)),
      lm_head_store_bytes_(prometheus::BuildGauge()
                               .Name("logprob_lm_head_store_bytes")
                               .Help("Bytes the lm_head store's files take (staged, committed and spare versions; "
                                     "in memory for a /dev/shm store).")
                               .Register(*registry_)
                               .Add({})),
      rollout_log_ratio_(prometheus::BuildHistogram()
                             .Name("logprob_rollout_log_ratio")
                             .Help("Per token l = logp - logp_rollout of the requests with rollout_logprobs (finite "
                                   "ones), by head (empty: logits requests).")
                             .Register(*registry_)),
      rollout_request_k3_(prometheus::BuildHistogram()
                              .Name("logprob_rollout_request_k3")
                              .Help("Per request mean(r - 1 - l), an estimate of KL(rollout || service) per token, "
                                    "by head (finite values).")
                              .Register(*registry_)),
      rollout_tokens_(prometheus::BuildCounter()
                          .Name("logprob_rollout_tokens_total")
                          .Help("Tokens compared with the rollout engine's logprobs, by head.")
                          .Register(*registry_)),
      rollout_outside_band_(prometheus::BuildCounter()
                                .Name("logprob_rollout_outside_band_tokens_total")
                                .Help("Compared tokens whose ratio r = exp(l) left the request's band (default "
                                      "[0.9, 1.1]), by head.")
                                .Register(*registry_)),
      rollout_infinite_(prometheus::BuildCounter()
                            .Name("logprob_rollout_infinite_log_ratios_total")
                            .Help("Compared tokens with an infinite l (one side's logprob is -inf), by head.")
                            .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("logprob_build_info")
      .Help("Build information; the value is 1.")
      .Register(*registry_)
      .Add({{"version", kVersion}, {"backend", backend}})
      .Set(1);
}

void Metrics::Expose(const std::string& listen) {
  exposer_ = std::make_unique<prometheus::Exposer>(listen);
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(memory_);
}

void Metrics::ObserveRequest(const std::string& method, const std::string& code, double seconds, int64_t tokens) {
  requests_.Add({{"method", method}, {"code", code}}).Increment();
  duration_.Add({{"method", method}}, SecondsBuckets()).Observe(seconds);
  if (tokens > 0) tokens_.Increment(static_cast<double>(tokens));
}

void Metrics::ObserveRequestBytes(const std::string& method, int64_t bytes) {
  // 256 B .. 1 GiB.
  static const prometheus::Histogram::BucketBoundaries kBuckets = [] {
    prometheus::Histogram::BucketBoundaries b;
    for (double v = 256; v <= double{1 << 30}; v *= 4) b.push_back(v);
    return b;
  }();
  request_bytes_.Add({{"method", method}}, kBuckets).Observe(static_cast<double>(bytes));
}

void Metrics::SetLoad(int64_t requests, int64_t tokens, int64_t bytes) {
  inflight_requests_.Set(static_cast<double>(requests));
  queued_tokens_.Set(static_cast<double>(tokens));
  queued_bytes_.Set(static_cast<double>(bytes));
}

void Metrics::ObserveBatch(const BatchStats& batch) {
  worker_call_duration_.Observe(batch.run_seconds);
  compute_duration_.Observe(batch.compute_seconds);
  collective_duration_.Observe(batch.collective_seconds);
  batch_tokens_.Observe(static_cast<double>(batch.rows));
  batch_requests_.Observe(batch.requests);
}

void Metrics::ObserveQueue(double seconds) { queue_duration_.Observe(seconds); }

void Metrics::SetLmHead(const std::string& head, const std::string& version, int64_t retained_bytes) {
  absl::MutexLock lock(&lm_head_mu_);
  if (auto it = lm_head_info_now_.find(head); it != lm_head_info_now_.end()) lm_head_info_.Remove(it->second);
  prometheus::Gauge& g = lm_head_info_.Add({{"head", head}, {"version", version}});
  g.Set(1);
  lm_head_info_now_[head] = &g;
  lm_head_retained_bytes_.Add({{"head", head}}).Set(static_cast<double>(retained_bytes));
}

void Metrics::SetLmHeadStoreBytes(int64_t bytes) { lm_head_store_bytes_.Set(static_cast<double>(bytes)); }

void Metrics::ObserveLmHeadUpdate(const std::string& head, const std::string& outcome, double seconds) {
  lm_head_updates_.Add({{"head", head}, {"outcome", outcome}}).Increment();
  lm_head_update_duration_.Add({{"head", head}}, SecondsBuckets()).Observe(seconds);
}

void Metrics::AddLmHeadUpdateBytes(const std::string& head, int64_t bytes) {
  lm_head_update_bytes_.Add({{"head", head}}).Increment(static_cast<double>(bytes));
}

void Metrics::SetSharedMemory(int64_t regions, int64_t bytes) {
  shm_regions_.Set(static_cast<double>(regions));
  shm_bytes_.Set(static_cast<double>(bytes));
}

void Metrics::SetQueued(int64_t requests) { queued_requests_.Set(static_cast<double>(requests)); }

void Metrics::SetRunningBatches(int64_t batches) { running_batches_.Set(static_cast<double>(batches)); }

void Metrics::SetWorkersWaiting(int n) { workers_waiting_.Set(n); }

void Metrics::AddJoinRefused() { joins_refused_.Increment(); }

void Metrics::SetGpuMemory(int worker, int64_t bytes) {
  gpu_memory_.Add({{"worker", std::to_string(worker)}}).Set(static_cast<double>(bytes));
}

void Metrics::SetWorkersUp(int n) { workers_up_.Set(n); }

void Metrics::AddWorkerRestart() { worker_restarts_.Increment(); }

void Metrics::ObserveRolloutMismatch(const std::string& head, const std::vector<float>& log_ratios,
                                     int64_t outside_band, double k3) {
  if (log_ratios.empty()) return;
  const prometheus::Labels labels = {{"head", head}};
  const auto& bounds = LogRatioBuckets();
  // One ObserveMultiple per request: a bucket index per token, no lock per token.
  std::vector<double> increments(bounds.size() + 1, 0);
  double sum = 0, infinite = 0;
  for (float l : log_ratios) {
    if (!std::isfinite(l)) {
      infinite += std::isinf(l) ? 1 : 0;
      continue;
    }
    // Prometheus buckets are "le": the first bound >= l.
    increments[std::lower_bound(bounds.begin(), bounds.end(), static_cast<double>(l)) - bounds.begin()] += 1;
    sum += l;
  }
  rollout_log_ratio_.Add(labels, bounds).ObserveMultiple(increments, sum);
  if (std::isfinite(k3)) rollout_request_k3_.Add(labels, K3Buckets()).Observe(k3);
  rollout_tokens_.Add(labels).Increment(static_cast<double>(log_ratios.size()));
  rollout_outside_band_.Add(labels).Increment(static_cast<double>(outside_band));
  rollout_infinite_.Add(labels).Increment(infinite);
}

}  // namespace logprob
