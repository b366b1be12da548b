#include "server/metrics.h"

#include "prometheus/counter.h"

namespace logprob {

Metrics::Metrics()
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
                           .Add({})) {
  prometheus::BuildGauge()
      .Name("logprob_build_info")
      .Help("Build information; the value is 1.")
      .Register(*registry_)
      .Add({{"version", "0.1.0"}, {"backend", "cpu"}})
      .Set(1);
}

void Metrics::Expose(const std::string& listen) {
  exposer_ = std::make_unique<prometheus::Exposer>(listen);
  exposer_->RegisterCollectable(registry_);
}

void Metrics::ObserveRequest(const std::string& method, const std::string& code, double seconds, int64_t tokens) {
  requests_.Add({{"method", method}, {"code", code}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                                    0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  duration_.Add({{"method", method}}, kBuckets).Observe(seconds);
  if (tokens > 0) tokens_.Increment(static_cast<double>(tokens));
}

void Metrics::SetWorkersUp(int n) { workers_up_.Set(n); }

void Metrics::AddWorkerRestart() { worker_restarts_.Increment(); }

}  // namespace logprob
