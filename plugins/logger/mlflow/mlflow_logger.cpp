// Built-in logger `mlflow`: metrics, hyperparameters, tags, the run's status and (optionally) its
// checkpoints to an MLflow tracking server over its REST API, as Lightning's MLFlowLogger does
// through the Python client. Checkpoints go up at the end (log_model=True) or each as it is saved
// (log_model="all"): the logger hears of every save as a CheckpointObserver (SDK 1.1).
//
// Only rank zero talks to the server. Metrics are buffered and sent with runs/log-batch,
// `batch_size` per request; a request that fails for a reason another try can fix (no answer,
// 5xx, 429) is retried with exponential back-off, and what still failed stays buffered and goes
// out with the next request, so a server that was briefly away loses nothing. While the server is
// known to be away, sends during training try once (training does not wait out the back-off at
// every flush); finalize() gets the full retries again. A server that never comes back costs no
// training: the run ends normally, its checkpoints are on disk, and what could not be delivered
// is written to <log_dir>/mlflow_unsent.json with an error naming the server.
//
// log_dir() is <default_root_dir>/mlruns/<experiment_id>/<run_id> (Lightning's layout), so
// model_checkpoint's default dirpath, <log_dir>/checkpoints, belongs to the run.
#include <fulgur/checkpoint_io.h>
#include <fulgur/plugin.h>
#include <fulgur/storage_root.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "../../common/writable_directory.h"
#include "http_client.h"
#include "tracking_api.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kOwner = "logger 'mlflow'";
// MLflow's limits for one runs/log-batch request (mlflow/utils/validation.py).
constexpr int64_t kMaxMetricsPerBatch = 1000;
constexpr size_t kMaxParamsPerBatch = 100;
constexpr size_t kMaxParamValueLength = 6000;
constexpr const char* kUnsentFile = "mlflow_unsent.json";
constexpr const char* kCheckpointArtifactDir = "checkpoints";

[[noreturn]] void config_error(const std::string& message) {
  throw fulgur::Error(fulgur::ErrorKind::config, fmt::format("{}: {}", kOwner, message));
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The option, else MLFLOW_TRACKING_URI (as MLflow's own client does); http(s) only, since only a
// tracking server speaks the REST API.
std::string tracking_uri(const std::string& option) {
  std::string uri = option;
  const char* env = std::getenv("MLFLOW_TRACKING_URI");
  if (uri.empty() && env) uri = env;
  const std::string from = option.empty() ? "MLFLOW_TRACKING_URI" : "tracking_uri";
  // No URI at all is refused by setup(), not here: `fulgur plugins check` creates every plugin
  // with its default options, and a logger that merely lacks its server is not broken.
  if (uri.empty()) return uri;
  if (!uri.starts_with("http://") && !uri.starts_with("https://"))
    config_error(
        fmt::format("{} = \"{}\" is not an http:// or https:// URI; this logger talks to an MLflow tracking "
                    "server (`mlflow server`), not to a local store",
                    from, uri));
  while (uri.ends_with('/')) uri.pop_back();
  return uri;
}

// "key=value" entries; the key is everything up to the first '='.
std::map<std::string, std::string> parse_tags(const std::vector<std::string>& entries) {
  std::map<std::string, std::string> tags;
  for (const std::string& entry : entries) {
    const size_t eq = entry.find('=');
    if (eq == std::string::npos || eq == 0)
      config_error(fmt::format("tags entry \"{}\" is not \"key=value\"; write e.g. tags = [\"team=vision\"]", entry));
    tags[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return tags;
}

// Hyperparameter values arrive as TOML value text; a TOML basic string without escapes is logged
// as its content ("adam", not "\"adam\""), as Python's str() of the value would be.
std::string param_value(const std::string& toml) {
  std::string value = toml;
  if (value.size() >= 2 && value.front() == '"' && value.back() == '"' && value.find('\\') == std::string::npos)
    value = value.substr(1, value.size() - 2);
  if (value.size() > kMaxParamValueLength) {
    fulgur::log::warn(fmt::format("{}: a hyperparameter value of {} characters is cut to MLflow's limit of {}", kOwner,
                                  value.size(), kMaxParamValueLength));
    value.resize(kMaxParamValueLength);
  }
  return value;
}

// MLflow's JSON takes non-finite doubles as the strings protobuf's JSON mapping uses.
json metric_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return value;
}

const char* mlflow_status(fulgur::RunStatus status) {
  switch (status) {
    case fulgur::RunStatus::success:
      return "FINISHED";
    case fulgur::RunStatus::failed:
      return "FAILED";
    case fulgur::RunStatus::interrupted:
      return "KILLED";
  }
  return "FAILED";
}

// The server's message from an error body ({"error_code": ..., "message": ...}), else the body.
std::string server_message(const fulgur::mlflow::HttpResponse& response) {
  const json body = json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_object() && body.contains("message") && body["message"].is_string())
    return fmt::format("HTTP {}: {}", response.status, body["message"].get<std::string>());
  return response.describe();
}

json parse_body(const fulgur::mlflow::HttpResponse& response, const std::string& uri, std::string_view what) {
  json body = json::parse(response.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded() || !body.is_object())
    throw fulgur::Error(fulgur::ErrorKind::io, fmt::format("{}: {} at {} answered with something that is not MLflow's "
                                                           "JSON: {}; is tracking_uri an MLflow tracking server?",
                                                           kOwner, what, uri, response.describe()));
  return body;
}

// A string field of an answer ({"run": {"info": {"run_id": ...}}}), or an error naming what is missing.
std::string string_at(const json& body, std::initializer_list<const char*> path, const std::string& uri,
                      std::string_view what) {
  const json* node = &body;
  for (const char* key : path) {
    if (!node->is_object() || !node->contains(key)) {
      node = nullptr;
      break;
    }
    node = &(*node)[key];
  }
  if (!node || !node->is_string())
    throw fulgur::Error(fulgur::ErrorKind::io, fmt::format("{}: {} at {} answered without the expected field: {}",
                                                           kOwner, what, uri, body.dump()));
  return node->get<std::string>();
}

struct Metric {
  std::string key;
  json value;
  int64_t timestamp_ms;
  int64_t step;
};

// A CheckpointObserver (SDK 1.1): it hears of every checkpoint the run writes, so it uploads
// exactly those, at the end or as each is saved, wherever model_checkpoint puts them.
class MlflowLogger final
    : public fulgur::WithExtensions<fulgur::Logger, fulgur::CheckpointObserver, fulgur::LoggerStorageRoot> {
 public:
  // [trainer] default_root_dir = "s3://..." (SDK 1.6): metrics, parameters and artifacts go to the
  // tracking server as always; only the unsent-rows file stays in the staging directory.
  void set_root_url(const std::string&) override {}
  std::string remote_log_dir() const override { return {}; }

  FULGUR_OPTIONS(Options,
                 (string, tracking_uri, "http(s)://host:port of `mlflow server`; empty: MLFLOW_TRACKING_URI", ""),
                 (string, experiment_name, "Experiment of the run; created when missing", "lightning_logs"),
                 (string, run_name, "Name shown for the run; empty: the server picks one", ""),
                 (string_list, tags, "Run tags as \"key=value\" entries", []),
                 (integer, batch_size, "Metric values per runs/log-batch request (1..1000); sent when this many wait",
                  100),
                 (boolean, log_model_checkpoints,
                  "Upload the run's checkpoints as artifacts under checkpoints/ (when: upload_when)", false),
                 (string, upload_when,
                  "\"end\": at the end, each checkpoint the run saved that is still on disk (Lightning's "
                  "log_model=True); \"saved\": each one as soon as it is written (log_model=\"all\")",
                  "end"),
                 (string, checkpoint_dir,
                  "At the end, upload every *.ckpt of this directory instead of the checkpoints the run saved", ""),
                 (integer, max_retries, "Retries of a request the server did not answer (or answered 5xx / 429)", 5),
                 (floating, retry_backoff, "Seconds before the first retry, doubled before each next one", 0.5));

  explicit MlflowLogger(const Options& options)
      : uri_(tracking_uri(options.tracking_uri)),
        experiment_name_(options.experiment_name),
        run_name_(options.run_name),
        tags_(parse_tags(options.tags)),
        batch_size_(options.batch_size),
        log_model_checkpoints_(options.log_model_checkpoints),
        upload_as_saved_(options.upload_when == "saved"),
        checkpoint_dir_(options.checkpoint_dir),
        retry_{options.max_retries, options.retry_backoff} {
    options.check(options.upload_when == "end" || options.upload_when == "saved", "upload_when",
                  "is neither \"end\" nor \"saved\"");
    options.check(!upload_as_saved_ || log_model_checkpoints_, "upload_when",
                  "uploads nothing while log_model_checkpoints = false; set log_model_checkpoints = true");
    options.check(!upload_as_saved_ || checkpoint_dir_.empty(), "checkpoint_dir",
                  "is read at the end only; with upload_when = \"saved\" each checkpoint is uploaded as it is "
                  "written, so remove checkpoint_dir");
    options.check(!experiment_name_.empty(), "experiment_name", "is empty; name the experiment the run belongs to");
    options.check(batch_size_ >= 1 && batch_size_ <= kMaxMetricsPerBatch, "batch_size",
                  fmt::format("is outside 1..{} (MLflow's limit for one runs/log-batch request)", kMaxMetricsPerBatch));
    options.check(retry_.max_retries >= 0 && retry_.max_retries <= 30, "max_retries", "is outside 0..30");
    options.check(retry_.backoff_s >= 0.0 && retry_.backoff_s <= 60.0, "retry_backoff", "s is outside 0..60");
    options.check(checkpoint_dir_.empty() || log_model_checkpoints_, "checkpoint_dir",
                  "is set but log_model_checkpoints = false, so nothing would be uploaded from it; set "
                  "log_model_checkpoints = true or remove checkpoint_dir");
  }

  ~MlflowLogger() override {
    // Values logged after finalize() (a test stage after fit) or by a run that never reached it
    // get one more chance, and are kept on disk if the server does not take them.
    if (!writes_ || run_id_.empty() || (pending_metrics_.empty() && pending_params_.empty())) return;
    try {
      // One try when the server is already known to be away: exit should not wait out the back-off twice.
      if (!send_pending(/*final=*/!server_away_)) report_undelivered("did not take every value");
    } catch (const std::exception& e) {
      fulgur::log::error(e.what());
      report_undelivered("refused values");
    }
  }

  void setup(const fulgur::LoggerSetup& setup) override {
    writes_ = setup.global_rank == 0;
    if (!writes_) {
      // Other ranks send nothing; the Trainer names the run by rank zero's log_dir anyway.
      log_dir_ = (fs::path(setup.root_dir) / "mlruns").string();
      return;
    }
    if (!run_id_.empty()) return;  // a later stage of the same Trainer: same run
    if (uri_.empty())
      config_error(
          "no tracking server: set tracking_uri (e.g. \"http://127.0.0.1:5000\") or the MLFLOW_TRACKING_URI variable");
    api_.emplace(uri_, retry_);
    const std::string experiment_id = find_or_create_experiment();
    create_run(experiment_id);
    log_dir_ = (fs::path(setup.root_dir) / "mlruns" / experiment_id / run_id_).string();
    fulgur::filesystem_checks::ensure_writable_directory(kOwner, log_dir_, "the log directory",
                                                         "[trainer] default_root_dir");
    fulgur::log::info(fmt::format("{}: run {} in experiment '{}' ({}) at {}", kOwner, run_id_, experiment_name_,
                                  experiment_id, uri_));
  }

  void log_metrics(const fulgur::MetricMap& metrics, int64_t step) override {
    if (!writes_) return;
    const int64_t timestamp = now_ms();
    for (const auto& [key, value] : metrics) pending_metrics_.push_back({key, metric_value(value), timestamp, step});
    if (static_cast<int64_t>(pending_metrics_.size()) >= batch_size_) send_pending(/*final=*/false);
  }

  void log_hyperparams(const std::map<std::string, std::string>& params) override {
    if (!writes_) return;
    for (const auto& [key, value] : params) pending_params_.emplace_back(key, param_value(value));
    send_pending(/*final=*/false);
  }

  void save() override {
    if (writes_ && !run_id_.empty()) send_pending(/*final=*/false);
  }

  void finalize(fulgur::RunStatus status) override {
    if (!writes_ || run_id_.empty() || finalized_) return;  // no run: setup failed and said why
    finalized_ = true;
    bool delivered = false;
    try {
      delivered = send_pending(/*final=*/true);
    } catch (const fulgur::Error& e) {
      fulgur::log::error(e.what());  // the server refused data; what is left goes to the file below
    }
    // A server that just outlasted every retry gets one more try for the status, and no uploads:
    // exit should not wait out the whole back-off once per request.
    const bool reachable = delivered || !server_away_;
    if (log_model_checkpoints_ && reachable) upload_checkpoints_at_end();
    if (log_model_checkpoints_ && !reachable)
      fulgur::log::error(fmt::format(
          "{}: the tracking server at {} is unreachable; the checkpoints were not uploaded and stay in {}", kOwner,
          uri_, checkpoint_dir_.empty() ? fmt::format("{}", fmt::join(saved_, ", ")) : checkpoint_dir_));
    const char* state = mlflow_status(status);
    const json update = {{"run_id", run_id_}, {"status", state}, {"end_time", now_ms()}};
    const fulgur::mlflow::HttpResponse answer = api_->post("runs/update", update, reachable ? retry_.attempts() : 1);
    const bool status_set = answer.ok();
    if (delivered && status_set) return;
    if (!status_set) unsent_status_ = state;
    report_undelivered(status_set ? "did not take every value" : fmt::format("could not be told the run {}", state));
  }

  std::string log_dir() const override { return log_dir_; }

  // CheckpointObserver: remembers what the run saved (for the end), and with upload_when = "saved"
  // uploads it now. A checkpoint written again under the same name (last.ckpt) goes up again.
  void after_save_checkpoint(const fulgur::SavedCheckpoint& checkpoint) override {
    if (!writes_ || run_id_.empty() || !log_model_checkpoints_) return;
    std::erase(saved_, checkpoint.path);
    saved_.push_back(checkpoint.path);
    uploaded_.erase(checkpoint.path);
    // A server known to be away is not waited for at every save; finalize() tries again.
    if (upload_as_saved_ && !server_away_) upload_checkpoint(checkpoint.path);
  }

 private:
  std::string find_or_create_experiment() {
    const std::string query = "experiments/get-by-name?experiment_name=" + fulgur::mlflow::url_encode(experiment_name_);
    fulgur::mlflow::HttpResponse found = api_->get(query, retry_.attempts());
    if (found.ok())
      return string_at(parse_body(found, uri_, "experiments/get-by-name"), {"experiment", "experiment_id"}, uri_,
                       "experiments/get-by-name");
    if (found.status != 404) unreachable_at_setup("experiments/get-by-name", found);
    const fulgur::mlflow::HttpResponse created =
        api_->post("experiments/create", {{"name", experiment_name_}}, retry_.attempts());
    if (created.ok()) {
      fulgur::log::info(fmt::format("{}: created experiment '{}' at {}", kOwner, experiment_name_, uri_));
      return string_at(parse_body(created, uri_, "experiments/create"), {"experiment_id"}, uri_, "experiments/create");
    }
    // Another process created it between the two requests: read it again.
    found = api_->get(query, retry_.attempts());
    if (found.ok())
      return string_at(parse_body(found, uri_, "experiments/get-by-name"), {"experiment", "experiment_id"}, uri_,
                       "experiments/get-by-name");
    unreachable_at_setup("experiments/create", created);
  }

  void create_run(const std::string& experiment_id) {
    json tags = json::array();
    for (const auto& [key, value] : tags_) tags.push_back({{"key", key}, {"value", value}});
    json request = {{"experiment_id", experiment_id}, {"start_time", now_ms()}, {"tags", tags}};
    if (!run_name_.empty()) request["run_name"] = run_name_;
    const fulgur::mlflow::HttpResponse created = api_->post("runs/create", request, retry_.attempts());
    if (!created.ok()) unreachable_at_setup("runs/create", created);
    const json body = parse_body(created, uri_, "runs/create");
    run_id_ = string_at(body, {"run", "info", "run_id"}, uri_, "runs/create");
    if (log_model_checkpoints_)
      artifact_root_ = proxied_artifact_root(string_at(body, {"run", "info", "artifact_uri"}, uri_, "runs/create"));
  }

  // The run's artifact_uri is "mlflow-artifacts:/<experiment>/<run>/artifacts" when the server
  // proxies artifacts (`mlflow server --serve-artifacts`, the default); the upload endpoint takes
  // the part after the scheme (and after an authority, "mlflow-artifacts://host:port/...").
  std::string proxied_artifact_root(const std::string& artifact_uri) {
    const std::string scheme = "mlflow-artifacts:";
    if (!artifact_uri.starts_with(scheme))
      throw fulgur::Error(fulgur::ErrorKind::config,
                          fmt::format("{}: log_model_checkpoints = true needs a server that proxies artifacts "
                                      "(`mlflow server --serve-artifacts`, the default), but run {} stores them at "
                                      "'{}'; start the server with --serve-artifacts or set log_model_checkpoints = "
                                      "false",
                                      kOwner, run_id_, artifact_uri));
    std::string path = artifact_uri.substr(scheme.size());
    if (path.starts_with("//")) {
      const size_t slash = path.find('/', 2);
      path = slash == std::string::npos ? std::string() : path.substr(slash);
    }
    while (path.starts_with('/')) path.erase(0, 1);
    return path;
  }

  [[noreturn]] void unreachable_at_setup(std::string_view what, const fulgur::mlflow::HttpResponse& response) {
    const std::string hint =
        response.status == 0
            ? fmt::format(
                  "after {} attempt(s); start the server (`mlflow server --host ... --port ...`) or fix "
                  "tracking_uri / MLFLOW_TRACKING_URI",
                  retry_.attempts())
            : "check tracking_uri / MLFLOW_TRACKING_URI and the server's log";
    throw fulgur::Error(fulgur::ErrorKind::io,
                        fmt::format("{}: {} at {} failed: {}; {}", kOwner, what, uri_, server_message(response), hint));
  }

  // Sends buffered params and metrics in runs/log-batch requests. Returns whether everything went
  // out; what did not stays buffered. A request the server refuses (4xx) throws: it would be
  // refused again.
  bool send_pending(bool final) {
    // During training a server known to be away gets one try per flush; finalize() all of them.
    const int64_t attempts = (server_away_ && !final) ? 1 : retry_.attempts();
    while (!pending_params_.empty() || !pending_metrics_.empty()) {
      const size_t params = std::min(pending_params_.size(), kMaxParamsPerBatch);
      const size_t metrics = std::min(pending_metrics_.size(), static_cast<size_t>(batch_size_));
      json body = {{"run_id", run_id_}, {"params", json::array()}, {"metrics", json::array()}};
      for (size_t i = 0; i < params; ++i)
        body["params"].push_back({{"key", pending_params_[i].first}, {"value", pending_params_[i].second}});
      for (size_t i = 0; i < metrics; ++i) body["metrics"].push_back(metric_json(pending_metrics_[i]));
      const fulgur::mlflow::HttpResponse response = api_->post("runs/log-batch", body, attempts);
      if (!response.ok()) {
        if (!response.transient())
          throw fulgur::Error(fulgur::ErrorKind::runtime,
                              fmt::format("{}: the tracking server at {} refused runs/log-batch for run {}: {}", kOwner,
                                          uri_, run_id_, server_message(response)));
        if (!server_away_ && !final)
          fulgur::log::warn(
              fmt::format("{}: the tracking server at {} is unreachable ({}) after {} attempt(s); {} metric value(s) "
                          "are kept and sent again with the next batch",
                          kOwner, uri_, response.describe(), attempts, pending_metrics_.size()));
        server_away_ = true;
        return false;
      }
      if (server_away_)
        fulgur::log::info(
            fmt::format("{}: the tracking server at {} is back; buffered values are being sent", kOwner, uri_));
      server_away_ = false;
      pending_params_.erase(pending_params_.begin(), pending_params_.begin() + static_cast<std::ptrdiff_t>(params));
      pending_metrics_.erase(pending_metrics_.begin(), pending_metrics_.begin() + static_cast<std::ptrdiff_t>(metrics));
    }
    return true;
  }

  static json metric_json(const Metric& m) {
    return {{"key", m.key}, {"value", m.value}, {"timestamp", m.timestamp_ms}, {"step", m.step}};
  }

  // At the end: every *.ckpt of checkpoint_dir when it is set; else each checkpoint the run saved
  // that is still on disk (model_checkpoint deletes what falls out of its top k), and with
  // upload_when = "saved" only those whose upload failed when they were written.
  void upload_checkpoints_at_end() {
    if (!checkpoint_dir_.empty()) {
      std::vector<fs::path> files;
      std::error_code error;
      for (const fs::directory_entry& entry : fs::directory_iterator(checkpoint_dir_, error))
        if (entry.is_regular_file(error) && entry.path().extension() == ".ckpt") files.push_back(entry.path());
      std::sort(files.begin(), files.end());
      if (files.empty())
        fulgur::log::warn(fmt::format("{}: log_model_checkpoints = true but checkpoint_dir '{}' holds no .ckpt file",
                                      kOwner, checkpoint_dir_));
      for (const fs::path& file : files) upload_checkpoint(file);
      return;
    }
    std::error_code error;
    size_t on_disk = 0;
    for (const std::string& path : saved_) {
      if (!fs::exists(path, error)) continue;
      ++on_disk;
      if (!upload_as_saved_ || !uploaded_.contains(path)) upload_checkpoint(path);
    }
    if (on_disk == 0)
      fulgur::log::warn(
          fmt::format("{}: log_model_checkpoints = true but the run kept no checkpoint to upload (add a "
                      "checkpoint callback such as model_checkpoint)",
                      kOwner));
  }

  // Uploads `checkpoint` (a file, or a sharded checkpoint's directory with every file below it) to
  // the run's artifacts under checkpoints/. A failed upload is reported, never fatal: the file
  // stays on disk. Returns whether every file went up.
  bool upload_checkpoint(const fs::path& checkpoint) {
    std::vector<std::pair<fs::path, std::string>> files;  // file, artifact path below checkpoints/
    std::error_code error;
    const std::string name = checkpoint.filename().string();
    if (fs::is_directory(checkpoint, error)) {
      for (const fs::directory_entry& entry : fs::recursive_directory_iterator(checkpoint, error))
        if (entry.is_regular_file(error))
          files.emplace_back(entry.path(), name + "/" + fs::relative(entry.path(), checkpoint, error).generic_string());
      std::sort(files.begin(), files.end());
    } else {
      files.emplace_back(checkpoint, name);
    }
    bool all = true;
    for (const auto& [file, artifact] : files) {
      std::string encoded;
      for (const auto& segment : fs::path(artifact)) encoded += "/" + fulgur::mlflow::url_encode(segment.string());
      const std::string path = fmt::format("{}/{}{}", artifact_root_, kCheckpointArtifactDir, encoded);
      const fulgur::mlflow::HttpResponse response = api_->put_artifact(path, file.string(), retry_.attempts());
      if (response.ok()) {
        fulgur::log::info(fmt::format("{}: uploaded {} to run {} as {}/{}", kOwner, file.string(), run_id_,
                                      kCheckpointArtifactDir, artifact));
      } else {
        all = false;
        fulgur::log::error(
            fmt::format("{}: uploading checkpoint {} to the tracking server at {} failed: {}; the file stays on disk",
                        kOwner, file.string(), uri_, server_message(response)));
      }
    }
    if (all) uploaded_.insert(checkpoint.string());
    return all;
  }

  void report_undelivered(const std::string& what) {
    const std::string file = write_unsent();
    fulgur::log::error(fmt::format(
        "{}: the tracking server at {} {}; {} metric value(s) and {} hyperparameter(s) of run {} were not delivered "
        "and are saved in {}. The run's checkpoints are on disk as usual.",
        kOwner, uri_, what, pending_metrics_.size(), pending_params_.size(), run_id_, file));
  }

  // What the server did not get, in runs/log-batch's own shape (plus the status it was not told),
  // so it can be sent later by hand.
  std::string write_unsent() {
    json body = {{"tracking_uri", uri_}, {"run_id", run_id_}, {"params", json::array()}, {"metrics", json::array()}};
    if (!unsent_status_.empty()) body["status"] = unsent_status_;
    for (const auto& [key, value] : pending_params_) body["params"].push_back({{"key", key}, {"value", value}});
    for (const Metric& m : pending_metrics_) body["metrics"].push_back(metric_json(m));
    const std::string path = (fs::path(log_dir_) / kUnsentFile).string();
    try {
      fulgur::atomic_write_text(path, body.dump(1) + "\n");
    } catch (const fulgur::Error& e) {
      fulgur::log::error(fmt::format("{}: {}", kOwner, e.what()));
    }
    return path;
  }

  std::string uri_;
  std::string experiment_name_;
  std::string run_name_;
  std::map<std::string, std::string> tags_;
  int64_t batch_size_;
  bool log_model_checkpoints_;
  bool upload_as_saved_;
  std::string checkpoint_dir_;
  fulgur::mlflow::RetryPolicy retry_;

  bool writes_ = false;
  bool finalized_ = false;
  bool server_away_ = false;
  std::optional<fulgur::mlflow::TrackingApi> api_;
  std::string run_id_;
  std::string artifact_root_;
  std::string unsent_status_;  // the final status the server could not be told
  std::string log_dir_;
  std::vector<std::pair<std::string, std::string>> pending_params_;
  std::vector<Metric> pending_metrics_;
  std::vector<std::string> saved_;  // the checkpoints the run wrote, oldest first (CheckpointObserver)
  std::set<std::string> uploaded_;  // those uploaded since they were last written
};

}  // namespace

FULGUR_PLUGIN(MlflowLogger, "mlflow", "0.2.0",
              "Metrics, hyperparameters, tags, status and checkpoints to an MLflow tracking server")
