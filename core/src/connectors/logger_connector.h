// Internal: everything between Module::log / TrainerContext::log_metrics and the logger plugins
// (Lightning's _LoggerConnector): the metric stores, the metrics callbacks and the progress bar
// read, the rows sent to loggers and at which step, and the loggers' own lifecycle.
#pragma once

#include <fulgur/logger.h>
#include <fulgur/trainer.h>
#include <fulgur/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "../hook_dispatcher.h"
#include "../metric_store.h"

namespace fulgur {

class LoggerConnector {
 public:
  explicit LoggerConnector(TrainerEngine& trainer) : trainer_(trainer) {}

  // The configured loggers, with who they are for error attribution.
  void connect(std::vector<Logger*> loggers, const std::vector<PluginIdentity>* identities);
  bool has_logger() const { return !loggers_.empty(); }

  // Logger setup and the hyperparameters, once per Trainer (several stages share the loggers).
  void setup_once();
  // Rank 0's log directory once the loggers are set up; default_root_dir before.
  const std::string& log_dir() const;
  // StorageRoot::log_url (fulgur/storage_root.h): the run directory's URL; default_root_url
  // before the loggers are set up ("" for a local run).
  const std::string& log_url() const;

  MetricStore& train_metrics() { return train_metrics_; }
  MetricStore& eval_metrics() { return eval_metrics_; }

  // TrainerContext::callback_metrics / progress_bar_metrics: step values are copied to the host
  // only when someone asks (no sync per training step).
  const MetricMap& callback_metrics() const;
  const MetricMap& progress_bar_metrics() const;
  const MetricMap& logged_metrics() const { return logged_metrics_; }

  // TrainerContext::log_metrics: values a plugin logs, on rank 0, with the cadence of the run.
  void log_metrics(const MetricMap& metrics, std::string_view owner);

  // The training batch's step-level row (with what callbacks logged during the batch) at `step`.
  void send_step_row(int64_t step);
  // The epoch-level values of `store` into the callback and progress bar metrics, and to the
  // loggers at the epoch's last step when `send_to_loggers`.
  void log_epoch_metrics(MetricStore& store, bool send_to_loggers);
  // The end of a validation/test pass: its epoch values (all of them are returned); a sanity
  // check pass changes nothing.
  MetricMap log_evaluation_epoch(bool sanity);
  // After the sanity check: nothing of it remains for callbacks or the progress bar.
  void clear_after_sanity_check();

  // Logger::save on every logger (end of an epoch and of a stage).
  void save();
  // Logger::finalize on every logger.
  void finalize(RunStatus status);
  // CheckpointObserver::after_save_checkpoint on every logger that offers it (SDK 1.1), once the
  // checkpoint is complete on every rank.
  void after_save_checkpoint(const SavedCheckpoint& checkpoint);

 private:
  // Rank zero's answer for log_url(), right after the loggers' setup.
  std::string first_log_url() const;
  template <class Fn>
  void for_each_logger(const char* method, Fn&& fn);
  void send_row(MetricMap row, int64_t step);
  // Step values into callback_metrics, "name_step" also as "name" (Lightning keeps the latest).
  void keep_step_values(const MetricMap& step_values) const;

  TrainerEngine& trainer_;
  std::vector<Logger*> loggers_;
  const std::vector<PluginIdentity>* identities_ = nullptr;
  bool ready_ = false;
  std::string log_dir_, log_url_;

  MetricStore train_metrics_, eval_metrics_;
  mutable MetricMap callback_metrics_, progress_bar_metrics_;
  MetricMap logged_metrics_;
  MetricMap pending_row_;  // values callbacks logged for the current step's row
};

}  // namespace fulgur
