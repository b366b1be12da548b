// Prometheus metrics of the front-end (prometheus-cpp), named in base
// units: *_total counters, *_seconds durations.
#pragma once

#include <memory>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace logprob {

/// The service's metrics; Expose() serves them over HTTP at /metrics.
class Metrics {
 public:
  Metrics();
  /// Starts the HTTP exposer on `listen` (host:port). Throws on bind errors
  /// (prometheus-cpp / civetweb).
  void Expose(const std::string& listen);

  /// Records one finished request of `method` with gRPC status `code` name.
  void ObserveRequest(const std::string& method, const std::string& code, double seconds, int64_t tokens);
  void SetWorkersUp(int n);
  /// Counts one re-formed worker pool generation.
  void AddWorkerRestart();

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Counter& tokens_;
  prometheus::Gauge& workers_up_;
  prometheus::Counter& worker_restarts_;
};

}  // namespace logprob
