// Built-in logger `tensorboard`: Lightning's TensorBoardLogger layout and content, written in
// TensorBoard's own on-disk format so that `tensorboard --logdir <save_dir>` shows the run.
//
//   <save_dir>/<name>/version_<N>[/<sub_dir>]/events.out.tfevents.*   scalars, text, hparams
//   <save_dir>/<name>/version_<N>/hparams.yaml                         "key: value" per hyperparameter
//
// Hyperparameters go three ways: hparams.yaml (as Lightning), a markdown table under the text tag
// "hparams", and the hparams plugin's records (the HPARAMS tab) with `hp_metric` as its metric.
// Events are buffered and flushed every `max_queue` events or `flush_secs` seconds, and on
// save()/finalize().
#include <fulgur/plugin.h>
#include <fulgur/storage_root.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../common/run_directory.h"
#include "../common/storage_mirror.h"
#include "event_file.h"
#include "summaries.h"

namespace {

namespace fs = std::filesystem;
namespace support = fulgur::run_directory;
using fulgur::tensorboard::EventBuilder;
using fulgur::tensorboard::EventFile;

constexpr char kOwner[] = "logger 'tensorboard'";
constexpr char kHpMetric[] = "hp_metric";

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A markdown table (the text dashboard renders markdown); '|' in values is escaped.
std::string hparams_table(const std::map<std::string, std::string>& hparams) {
  auto cell = [](const std::string& text) {
    std::string out;
    for (char c : text) {
      if (c == '|') out += '\\';
      out += c;
    }
    return out;
  };
  std::string table = "| hyperparameter | value |\n|---|---|\n";
  for (const auto& [key, value] : hparams) table += fmt::format("| {} | {} |\n", cell(key), cell(value));
  return table;
}

class TensorBoardLogger final : public fulgur::WithExtensions<fulgur::Logger, fulgur::LoggerStorageRoot> {
 public:
  // [trainer] default_root_dir = "s3://...": an empty save_dir means that URL (SDK 1.6).
  void set_root_url(const std::string& url) override {
    if (save_dir_.empty()) save_dir_ = url;
  }
  std::string remote_log_dir() const override { return mirror_.remote_dir(); }

  FULGUR_OPTIONS(Options,
                 (string, save_dir,
                  "Root directory; empty means the Trainer's default_root_dir; a URL (s3://bucket/prefix): files "
                  "staged under default_root_dir and uploaded on every flush",
                  ""),
                 (string, name, "Experiment name: the directory under save_dir", "lightning_logs"),
                 (integer, version, "Run version; -1 picks the next free version_N", -1),
                 (string, sub_dir, "Optional directory under version_N for the event files", ""),
                 (string, prefix, "Prepended to every metric name, joined with '-'", ""),
                 (boolean, default_hp_metric,
                  "Log hp_metric = -1 with the hyperparameters (the HPARAMS tab's metric column)", true),
                 (floating, flush_secs, "Write buffered events to disk at least this often (seconds)", 120.0),
                 (integer, max_queue, "Write buffered events to disk after this many events", 10));
  explicit TensorBoardLogger(const Options& options)
      : save_dir_(options.save_dir),
        name_(options.name),
        version_(options.version),
        sub_dir_(options.sub_dir),
        prefix_(options.prefix),
        default_hp_metric_(options.default_hp_metric),
        flush_secs_(options.flush_secs),
        max_queue_(options.max_queue) {
    options.check(version_ >= -1, "version", "is not valid; use -1 for the next free version_N or a number >= 0");
    options.check(max_queue_ >= 1, "max_queue", "must be at least 1");
    options.check(!(flush_secs_ < 0), "flush_secs", "must be >= 0");
    options.check(sub_dir_.empty() || !fs::path(sub_dir_).is_absolute(), "sub_dir",
                  "must be relative to the version directory");
  }

  ~TensorBoardLogger() override {
    // A run that dies without finalize() should still leave its buffered events on disk.
    try {
      file_.close();
      if (!file_.path().empty()) mirror_.upload(kOwner, file_.path());
    } catch (const std::exception& e) {
      fulgur::log::error(e.what());
    }
  }

  void setup(const fulgur::LoggerSetup& setup) override {
    writes_ = setup.global_rank == 0;
    if (version_dir_.empty()) {
      // A URL: staged locally under default_root_dir, uploaded on every flush (storage_mirror.h).
      const bool remote = fulgur::is_storage_url(save_dir_);
      const fs::path root = fs::path(save_dir_.empty() || remote ? setup.root_dir : save_dir_) / name_;
      const std::string remote_root = remote ? fulgur::join_storage_path(save_dir_, name_) : std::string();
      // Every rank computes the same path; only rank zero creates it.
      int64_t version = version_;
      if (version < 0) {
        version = support::next_free_version(root);
        if (remote) version = std::max(version, support::next_free_version_at(remote_root));
      }
      version_dir_ = (root / fmt::format("version_{}", version)).string();
      log_dir_ = sub_dir_.empty() ? version_dir_ : (fs::path(version_dir_) / sub_dir_).string();
      if (remote)
        mirror_.start(version_dir_, fulgur::join_storage_path(remote_root, fmt::format("version_{}", version)));
    }
    if (!writes_ || file_.is_open()) return;
    // Checked now; the event file itself is created by the first write, so that the directory
    // stays empty until then and a csv logger set up after this one joins the same version_N.
    support::ensure_writable_directory(kOwner, log_dir_);
  }

  void log_metrics(const fulgur::MetricMap& metrics, int64_t step) override {
    if (!ensure_open()) return;
    values_.clear();
    if (prefix_.empty()) {
      for (const auto& [key, value] : metrics) values_.emplace_back(key, value);
    } else {
      prefixed_.clear();
      prefixed_.reserve(metrics.size());
      for (const auto& [key, value] : metrics) prefixed_.push_back(prefix_ + "-" + key);
      size_t i = 0;
      for (const auto& [key, value] : metrics) values_.emplace_back(prefixed_[i++], value);
    }
    write(builder_.scalars(wall_time(), step, values_));
  }

  void log_hyperparams(const std::map<std::string, std::string>& params) override {
    if (!writes_) return;
    for (const auto& [key, value] : params) hparams_[key] = value;
    hparams_dirty_ = true;
    if (!ensure_open()) return;
    const double now = wall_time();
    file_.write(builder_.text(now, 0, "hparams", hparams_table(hparams_)));
    std::vector<std::string> metrics;
    if (default_hp_metric_) metrics.emplace_back(kHpMetric);
    file_.write(builder_.hparams_experiment(now, hparams_, metrics));
    file_.write(builder_.hparams_session_start(now, hparams_));
    // Lightning's default_hp_metric: a placeholder the user overwrites by logging "hp_metric".
    if (default_hp_metric_) file_.write(builder_.scalars(now, 0, {{kHpMetric, -1.0}}));
    flush();
  }

  void save() override {
    if (!writes_) return;
    flush();
    if (hparams_dirty_ && !version_dir_.empty()) {
      support::write_hparams_yaml(log_dir_, hparams_);
      mirror_.upload(kOwner, (fs::path(log_dir_) / "hparams.yaml").string());
      hparams_dirty_ = false;
    }
  }

  void finalize(fulgur::RunStatus status) override {
    if (!writes_) return;
    if (file_.is_open() && !hparams_.empty())
      file_.write(builder_.hparams_session_end(wall_time(), status == fulgur::RunStatus::success ? 1 : 2));
    save();
  }

  std::string log_dir() const override { return log_dir_; }

 private:
  bool ensure_open() {
    if (file_.is_open()) return true;
    if (!writes_ || log_dir_.empty()) return false;
    file_.open(log_dir_, kOwner);
    last_flush_ = std::chrono::steady_clock::now();
    return true;
  }

  void write(const std::string& event) {
    file_.write(event);
    const auto now = std::chrono::steady_clock::now();
    if (++queued_ >= max_queue_ || std::chrono::duration<double>(now - last_flush_).count() >= flush_secs_) {
      flush();
      queued_ = 0;
      last_flush_ = now;
    }
  }

  // The event file to disk, and to object storage when save_dir is a URL.
  void flush() {
    file_.flush();
    if (file_.is_open()) mirror_.upload(kOwner, file_.path());
  }

  // Options.
  std::string save_dir_;
  std::string name_;
  int64_t version_;
  std::string sub_dir_;
  std::string prefix_;
  bool default_hp_metric_;
  double flush_secs_;
  int64_t max_queue_;

  // State.
  bool writes_ = false;
  std::string version_dir_, log_dir_;
  EventFile file_;
  EventBuilder builder_;
  std::vector<std::pair<std::string_view, double>> values_;
  std::vector<std::string> prefixed_;
  std::map<std::string, std::string> hparams_;
  bool hparams_dirty_ = false;
  int64_t queued_ = 0;
  std::chrono::steady_clock::time_point last_flush_;
  support::StorageMirror mirror_;  // save_dir on object storage
};

}  // namespace

FULGUR_PLUGIN(TensorBoardLogger, "tensorboard", "0.1.0",
              "Scalars, text and hyperparameters as TensorBoard event files under <save_dir>/<name>/version_N "
              "(Lightning's TensorBoardLogger)")
