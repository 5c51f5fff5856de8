#include "tracking_api.h"

#include <fulgur/log.h>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <thread>

namespace fulgur::mlflow {

TrackingApi::TrackingApi(std::string uri, RetryPolicy retry) : uri_(std::move(uri)), retry_(retry) {}

HttpResponse TrackingApi::post(std::string_view endpoint, const nlohmann::json& body, int64_t attempts) {
  const std::string url = fmt::format("{}/api/2.0/mlflow/{}", uri_, endpoint);
  const std::string text = body.dump();
  return with_retries(endpoint, attempts, [&] { return http_.post_json(url, text); });
}

HttpResponse TrackingApi::get(std::string_view endpoint_and_query, int64_t attempts) {
  const std::string url = fmt::format("{}/api/2.0/mlflow/{}", uri_, endpoint_and_query);
  const std::string_view what = endpoint_and_query.substr(0, endpoint_and_query.find('?'));
  return with_retries(what, attempts, [&] { return http_.get(url); });
}

HttpResponse TrackingApi::put_artifact(const std::string& artifact_path, const std::string& file, int64_t attempts) {
  const std::string url = fmt::format("{}/api/2.0/mlflow-artifacts/artifacts/{}", uri_, artifact_path);
  return with_retries("artifact upload", attempts, [&] { return http_.put_file(url, file); });
}

HttpResponse TrackingApi::with_retries(std::string_view what, int64_t attempts,
                                       const std::function<HttpResponse()>& request) {
  HttpResponse response;
  for (int64_t attempt = 0; attempt < attempts; ++attempt) {
    if (attempt > 0) {
      const double wait_s = retry_.backoff_s * std::pow(2.0, static_cast<double>(attempt - 1));
      std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
    }
    response = request();
    if (response.ok()) {
      if (outage_reported_)
        fulgur::log::info(fmt::format("logger 'mlflow': the tracking server at {} answers again", uri_));
      outage_reported_ = false;
      return response;
    }
    if (!response.transient()) return response;
    // One warning per outage, not one per try: a server that is down for a minute must not
    // flood the log.
    if (!outage_reported_ && attempt + 1 < attempts)
      fulgur::log::warn(
          fmt::format("logger 'mlflow': {} at {} failed ({}); retrying up to {} more time(s), first in {} s", what,
                      uri_, response.describe(), attempts - attempt - 1, retry_.backoff_s));
    if (attempt + 1 < attempts) outage_reported_ = true;
  }
  return response;
}

}  // namespace fulgur::mlflow
