// MLflow's tracking REST API (/api/2.0/mlflow/...) and the proxied artifact upload
// (/api/2.0/mlflow-artifacts/artifacts/...), with retries and exponential back-off for the
// failures that another try can fix (no answer, 5xx, 429).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "http_client.h"

namespace fulgur::mlflow {

struct RetryPolicy {
  int64_t max_retries = 5;  // tries after the first one
  double backoff_s = 0.5;   // wait before the first retry; doubled before each next one
  int64_t attempts() const { return 1 + max_retries; }
};

class TrackingApi {
 public:
  // `uri`: "http(s)://host:port[/prefix]" without a trailing '/'.
  TrackingApi(std::string uri, RetryPolicy retry);

  const std::string& uri() const { return uri_; }
  const RetryPolicy& retry() const { return retry_; }

  // `endpoint` is relative to /api/2.0/mlflow/ ("runs/log-batch"); at most `attempts` tries.
  HttpResponse post(std::string_view endpoint, const nlohmann::json& body, int64_t attempts);
  HttpResponse get(std::string_view endpoint_and_query, int64_t attempts);
  // `artifact_path` is relative to /api/2.0/mlflow-artifacts/artifacts/ (already '/'-separated).
  HttpResponse put_artifact(const std::string& artifact_path, const std::string& file, int64_t attempts);

 private:
  HttpResponse with_retries(std::string_view what, int64_t attempts, const std::function<HttpResponse()>& request);

  std::string uri_;
  RetryPolicy retry_;
  HttpClient http_;
  // A warning went out for the current outage; the next success says the server is back.
  bool outage_reported_ = false;
};

}  // namespace fulgur::mlflow
