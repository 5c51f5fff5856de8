#include "logger_connector.h"

#include <fulgur/error.h>
#include <fulgur/extension.h>
#include <fulgur/storage.h>
#include <fulgur/storage_root.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include <map>

#include "../trainer_engine.h"

namespace fulgur {

template <class Fn>
void LoggerConnector::for_each_logger(const char* method, Fn&& fn) {
  for (size_t i = 0; i < loggers_.size(); ++i)
    trainer_.hooks_.logger((*identities_)[i], method, [&] { fn(*loggers_[i]); });
}

void LoggerConnector::connect(std::vector<Logger*> loggers, const std::vector<PluginIdentity>* identities) {
  loggers_ = std::move(loggers);
  identities_ = identities;
}

void LoggerConnector::setup_once() {
  if (ready_) return;
  TrainerEngine& t = trainer_;
  LoggerSetup setup;
  setup.root_dir = t.trainer_config_.default_root_dir;
  setup.global_rank = t.plugins_.strategy->cluster().global_rank;
  const std::string& root_url = t.trainer_config_.default_root_url;
  if (!root_url.empty())
    for (size_t i = 0; i < loggers_.size(); ++i) {
      // A URL root: each logger that can upload is told what its empty save_dir stands for; the
      // others write to the staging directory as they always did (SDK 1.5 loggers among them).
      if (auto* remote = find_extension<LoggerStorageRoot>(*loggers_[i]))
        trainer_.hooks_.logger((*identities_)[i], "set_root_url", [&] { remote->set_root_url(root_url); });
      else if (setup.global_rank == 0)
        spdlog::warn(
            "logger '{}' does not write to object storage (it does not offer {}): its files stay in {}, "
            "not below default_root_dir = \"{}\"",
            (*identities_)[i].name, LoggerStorageRoot::kExtensionId, setup.root_dir, root_url);
    }
  for_each_logger("setup", [&](Logger& l) { l.setup(setup); });
  ready_ = true;
  // Every rank names the run by rank 0's directory (the loggers of other ranks write nothing, and
  // their own version numbering may differ).
  log_dir_ = t.plugins_.strategy->broadcast_string(
      loggers_.empty() ? t.trainer_config_.default_root_dir : loggers_.front()->log_dir(), 0);
  log_url_ = t.plugins_.strategy->broadcast_string(first_log_url(), 0);
  // Hyperparameters of model, data and trainer, flattened with their table as prefix. Model and
  // data come from the objects (attach() fills them from [model] / [data] unless set in code), so
  // hyperparameters a Module sets itself are logged too; the selected accelerator, strategy,
  // precision and profiler add their options.
  const Config& config = t.config_;
  std::map<std::string, std::string> params;
  auto add = [&](const std::string& prefix, const Options& options) {
    for (const auto& [k, v] : options.values()) params[prefix + k] = format_option_value(v);
  };
  add("model.", t.module_ ? t.module_->hparams : config.model);
  add("data.", t.data_ ? t.data_->hparams : config.data);
  add("trainer.", config.trainer);
  add("accelerator.", config.accelerator.options);
  add("strategy.", config.strategy.options);
  add("precision.", config.precision.options);
  if (config.profiler) {
    params["profiler.name"] = format_option_value(OptionValue(config.profiler->name));
    add("profiler.", config.profiler->options);
  }
  for_each_logger("log_hyperparams", [&](Logger& l) { l.log_hyperparams(params); });
}

const std::string& LoggerConnector::log_dir() const {
  return ready_ ? log_dir_ : trainer_.trainer_config_.default_root_dir;
}

const std::string& LoggerConnector::log_url() const {
  return ready_ ? log_url_ : trainer_.trainer_config_.default_root_url;
}

std::string LoggerConnector::first_log_url() const {
  const std::string& root_url = trainer_.trainer_config_.default_root_url;
  if (loggers_.empty()) return root_url;
  Logger& first = *loggers_.front();
  if (auto* remote = find_extension<LoggerStorageRoot>(first)) {
    // Below the root (or with a local root): checkpoints beside it are found again by listing it.
    std::string url = remote->remote_log_dir();
    if (!url.empty() && (root_url.empty() || url.starts_with(join_storage_path(root_url, "")))) return url;
  }
  if (root_url.empty()) return {};
  // A logger that stays local under the staging directory: its place there, moved to the URL (so
  // checkpoints beside its run directory reach object storage all the same).
  const std::filesystem::path relative =
      std::filesystem::path(first.log_dir()).lexically_relative(trainer_.trainer_config_.default_root_dir);
  if (relative.empty() || *relative.begin() == "..") return root_url;
  return join_storage_path(root_url, relative.generic_string());
}

void LoggerConnector::keep_step_values(const MetricMap& step_values) const {
  for (const auto& [k, v] : step_values) {
    callback_metrics_[k] = v;
    if (k.ends_with("_step")) callback_metrics_[k.substr(0, k.size() - 5)] = v;
  }
}

const MetricMap& LoggerConnector::callback_metrics() const {
  keep_step_values(const_cast<MetricStore&>(train_metrics_).collect_step(false, false, false));
  return callback_metrics_;
}

const MetricMap& LoggerConnector::progress_bar_metrics() const {
  for (const auto& [k, v] : train_metrics_.prog_bar_step_values()) progress_bar_metrics_[k] = v;
  return progress_bar_metrics_;
}

void LoggerConnector::log_metrics(const MetricMap& metrics, std::string_view owner) {
  if (loggers_.empty())
    throw Error(ErrorKind::config,
                fmt::format("{}: the Trainer has no logger, so there is nowhere to write its values; add a "
                            "[[loggers]] table (`fulgur plugins list` shows the loggers) or remove the callback",
                            owner));
  if (metrics.empty() || trainer_.global_rank() != 0) return;
  const TrainingEpochLoop& epoch_loop = trainer_.fit_loop_.epoch_loop();
  if (epoch_loop.in_batch()) {
    // Joins the Trainer's own row for this step (sent at the end of the batch when due).
    for (const auto& [k, v] : metrics) pending_row_[k] = v;
    return;
  }
  // Outside a batch, Lightning's step: the steps taken so far, or at an epoch's end the epoch's
  // last step (where its epoch-level row goes).
  const int64_t global_step = trainer_.global_step();
  const int64_t step = epoch_loop.in_epoch_end_phase() ? global_step - 1 : global_step;
  send_row(metrics, std::max<int64_t>(0, step));
}

void LoggerConnector::send_row(MetricMap row, int64_t step) {
  if (row.empty() || loggers_.empty()) return;
  row["epoch"] = static_cast<double>(trainer_.current_epoch());
  for_each_logger("log_metrics", [&](Logger& l) { l.log_metrics(row, step); });
  for (const auto& [k, v] : row)
    if (k != "epoch") logged_metrics_[k] = v;
}

void LoggerConnector::send_step_row(int64_t step) {
  MetricMap metrics = train_metrics_.collect_step(/*logger_only=*/true, false, /*consume=*/true);
  // The values stay in callback_metrics after they went to the loggers (Lightning keeps the latest
  // step values there; the ones not for loggers are still fresh and collected when asked).
  keep_step_values(metrics);
  for (const auto& [k, v] : pending_row_) metrics[k] = v;
  pending_row_.clear();
  // Lightning's step for loggers is the number of batches that stepped before this one, which is
  // never negative (a micro-step of an accumulation window belongs to the step it builds).
  send_row(std::move(metrics), step);
}

void LoggerConnector::log_epoch_metrics(MetricStore& store, bool send_to_loggers) {
  MetricMap all;
  MetricMap for_loggers =
      store.reduce_epoch(trainer_.plugins_.strategy.get(), /*logger_only=*/true, &progress_bar_metrics_, &all);
  for (const auto& [k, v] : all) callback_metrics_[k] = v;
  if (!send_to_loggers) return;
  for (const auto& [k, v] : pending_row_) for_loggers[k] = v;
  pending_row_.clear();
  send_row(std::move(for_loggers), std::max<int64_t>(0, trainer_.fit_loop_.epoch_loop().batches_that_stepped() - 1));
}

MetricMap LoggerConnector::log_evaluation_epoch(bool sanity) {
  MetricMap all;
  MetricMap for_loggers =
      eval_metrics_.reduce_epoch(trainer_.plugins_.strategy.get(), true, &progress_bar_metrics_, &all);
  if (!sanity) {
    for (const auto& [k, v] : all) callback_metrics_[k] = v;
    send_row(std::move(for_loggers), std::max<int64_t>(0, trainer_.fit_loop_.epoch_loop().batches_that_stepped() - 1));
  }
  return all;
}

void LoggerConnector::clear_after_sanity_check() {
  eval_metrics_.clear();
  callback_metrics_.clear();
  progress_bar_metrics_.clear();
}

void LoggerConnector::save() {
  for_each_logger("save", [&](Logger& l) { l.save(); });
}

void LoggerConnector::finalize(RunStatus status) {
  for_each_logger("finalize", [&](Logger& l) { l.finalize(status); });
}

void LoggerConnector::after_save_checkpoint(const SavedCheckpoint& checkpoint) {
  for_each_logger("after_save_checkpoint", [&](Logger& l) {
    if (auto* observer = find_extension<CheckpointObserver>(l)) observer->after_save_checkpoint(checkpoint);
  });
}

}  // namespace fulgur
