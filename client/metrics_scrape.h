// Reading logprob-server's Prometheus /metrics (--metrics-listen) from
// the client: a plain HTTP GET and the sums of histogram series.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace logprob::client {

/// Fetches `url` ("http://HOST:PORT/PATH"; PATH defaults to /metrics) with
/// an HTTP/1.0 GET, waiting at most `timeout_seconds` for each socket
/// operation. Returns the body of a 200 answer. Errors
/// (INVALID_ARGUMENT naming --metrics-url for a malformed URL, UNAVAILABLE
/// otherwise): not http://, no port, cannot resolve or connect, a status
/// other than 200.
absl::StatusOr<std::string> HttpGet(const std::string& url, double timeout_seconds = 5);

/// Sum and count of a histogram, added over its series.
struct HistogramTotals {
  double sum = 0;
  double count = 0;
};

/// The `NAME_sum` and `NAME_count` samples of histogram `name` in
/// Prometheus text exposition `text`, added over every series whose label
/// set contains `label` (e.g. `method="Score"`; empty: every series).
/// Missing series give zeros.
HistogramTotals ParseHistogramTotals(absl::string_view text, absl::string_view name, absl::string_view label = "");

}  // namespace logprob::client
