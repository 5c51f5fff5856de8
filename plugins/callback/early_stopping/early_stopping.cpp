// Built-in callback `early_stopping`: Lightning's EarlyStopping. After each validation (or each
// training epoch) it compares a monitored metric with the best value so far and asks the Trainer
// to stop once it has not improved by more than min_delta for `patience` checks, when it crosses
// a threshold, or when it stops being finite.
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"

#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <string>

namespace {

namespace support = fulgur::callback_conventions;
using fulgur::Error;
using fulgur::ErrorKind;
using support::MonitorMode;

constexpr char kOwner[] = "callback 'early_stopping'";

// Thresholds are optional; TOML's `nan` (the default) means "not set", as Python's None does.
std::optional<double> optional_threshold(double value) {
  if (std::isnan(value)) return std::nullopt;
  return value;
}

class EarlyStopping final : public fulgur::Callback {
 public:
  FULGUR_OPTIONS(Options, (string, monitor, "Logged metric to watch, e.g. \"val/loss\""),
                 (string, mode, "\"min\" (stop when it stops decreasing) or \"max\"", "min"),
                 (integer, patience, "Checks without improvement before stopping (checks, not epochs)", 3),
                 (floating, min_delta, "Smallest change that counts as an improvement", 0.0),
                 (boolean, check_finite, "Stop when the metric becomes NaN or infinite", true),
                 (floating, stopping_threshold, "Stop as soon as the metric is better than this; nan: off", nan),
                 (floating, divergence_threshold, "Stop as soon as the metric is worse than this; nan: off", nan),
                 (boolean, check_on_train_epoch_end,
                  "Check at the end of each training epoch instead of after validation (always so without "
                  "validation)",
                  false),
                 (boolean, strict, "A monitor that is not logged is an error (false: skip the check)", true),
                 (boolean, verbose, "Log improvements and the reason for stopping", false),
                 (boolean, log_rank_zero_only, "In multi-process runs, log from rank zero only", false));

  explicit EarlyStopping(const Options& options)
      : monitor_(options.monitor),
        mode_(support::parse_mode(kOwner, options.mode)),
        patience_(options.patience),
        // Signed so that "current - min_delta better than best" reads the same in both modes.
        min_delta_(std::abs(options.min_delta) * (mode_ == MonitorMode::max ? 1.0 : -1.0)),
        check_finite_(options.check_finite),
        stopping_threshold_(optional_threshold(options.stopping_threshold)),
        divergence_threshold_(optional_threshold(options.divergence_threshold)),
        check_on_train_epoch_end_(options.check_on_train_epoch_end),
        strict_(options.strict),
        verbose_(options.verbose),
        log_rank_zero_only_(options.log_rank_zero_only),
        best_score_(support::worst_score(mode_)) {
    if (monitor_.empty())
      throw Error(ErrorKind::config, fmt::format("{}: monitor is empty; name the logged metric to watch, e.g. "
                                                 "monitor = \"val/loss\"",
                                                 kOwner));
    options.check(patience_ >= 0, "patience", "must be >= 0");
  }

  fulgur::HookSet hooks() const override {
    return fulgur::Hook::setup | fulgur::Hook::teardown | fulgur::Hook::train_epoch_end | fulgur::Hook::validation_end;
  }
  // A monitor: its epoch-end check sees the values the Module logs in on_train_epoch_end.
  fulgur::CallbackRoles roles() const override {
    return static_cast<fulgur::CallbackRoles>(fulgur::CallbackRole::monitor);
  }

  void setup(fulgur::TrainerContext&, fulgur::Stage stage) override { fitting_ = stage == fulgur::Stage::fit; }
  void teardown(fulgur::TrainerContext&, fulgur::Stage) override { fitting_ = false; }

  void on_train_epoch_end(fulgur::TrainerContext& trainer) override {
    if (should_skip_check(trainer)) return;
    // Without validation in this run on_validation_end never comes, so a check "after
    // validation" would silently never happen; the epoch end is then the only place to check
    // (Lightning's automatic choice does the same).
    bool no_validation = trainer.num_batches(fulgur::Stage::validate) == 0;
    if (check_on_train_epoch_end_ || no_validation) run_check(trainer);
  }

  void on_validation_end(fulgur::TrainerContext& trainer) override {
    if (check_on_train_epoch_end_ || should_skip_check(trainer)) return;
    run_check(trainer);
  }

  std::string state_key() const override {
    return fmt::format("EarlyStopping{{'monitor': {}, 'mode': '{}'}}", support::python_repr(monitor_),
                       support::to_string(mode_));
  }

  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    state.insert("wait_count", wait_count_);
    state.insert("stopped_epoch", stopped_epoch_);
    state.insert("best_score", support::score_value(best_score_));
    state.insert("patience", patience_);
    out = c10::IValue(state);
  }

  void load_state_dict(const c10::IValue& state) override {
    const auto dict = support::expect_dict(kOwner, state);
    wait_count_ = support::get_optional_int(kOwner, dict, "wait_count").value_or(0);
    stopped_epoch_ = support::get_optional_int(kOwner, dict, "stopped_epoch").value_or(0);
    best_score_ = support::get_optional_double(kOwner, dict, "best_score").value_or(support::worst_score(mode_));
    // Lightning restores patience from the checkpoint too, so a resumed run keeps its budget.
    patience_ = support::get_optional_int(kOwner, dict, "patience").value_or(patience_);
  }

 private:
  bool should_skip_check(fulgur::TrainerContext& trainer) const { return !fitting_ || trainer.sanity_checking(); }

  void run_check(fulgur::TrainerContext& trainer) {
    const fulgur::MetricMap& metrics = trainer.callback_metrics();
    auto found = metrics.find(monitor_);
    if (found == metrics.end()) {
      if (strict_) throw support::missing_metric_error(kOwner, monitor_, support::metric_names(metrics));
      if (verbose_)
        log(trainer,
            fmt::format("early stopping is conditioned on \"{}\", which is not logged; check skipped", monitor_));
      return;
    }
    std::string reason;
    bool stop = evaluate(found->second, reason);
    // Stop every process if any one decides to (Lightning reduces with all=False): the ranks
    // must leave the loop together, and an unsynced metric may differ between them.
    bool stop_everywhere = trainer.agree(stop, /*all=*/false);
    if (!stop_everywhere) {
      if (verbose_ && !reason.empty()) log(trainer, reason);
      return;
    }
    stopped_epoch_ = trainer.current_epoch();
    // The Trainer logs the reason it is given; logging it here too would print it twice.
    trainer.request_stop(stop ? reason
                              : fmt::format("Another process stopped on monitored metric {}. Signaling Trainer to "
                                            "stop.",
                                            monitor_));
  }

  // Lightning's _evaluate_stopping_criteria, in the same order and with the same messages.
  bool evaluate(double current, std::string& reason) {
    if (check_finite_ && !std::isfinite(current)) {
      reason = fmt::format(
          "Monitored metric {} = {} is not finite. Previous best value was {:.3f}. Signaling Trainer "
          "to stop.",
          monitor_, support::python_float_repr(current), best_score_);
      return true;
    }
    const char* better = mode_ == MonitorMode::min ? "<" : ">";
    const char* worse = mode_ == MonitorMode::min ? ">" : "<";
    if (stopping_threshold_ && support::is_better(mode_, current, *stopping_threshold_)) {
      reason =
          fmt::format("Stopping threshold reached: {} = {} {} {}. Signaling Trainer to stop.", monitor_,
                      support::python_float_repr(current), better, support::python_float_repr(*stopping_threshold_));
      return true;
    }
    // Diverging: past the threshold in the bad direction. (Lightning prints the "better" sign here
    // too, which reads as the opposite of what happened; the message shows the true relation.)
    if (divergence_threshold_ && support::is_better(mode_, -current, -*divergence_threshold_)) {
      reason =
          fmt::format("Divergence threshold reached: {} = {} {} {}. Signaling Trainer to stop.", monitor_,
                      support::python_float_repr(current), worse, support::python_float_repr(*divergence_threshold_));
      return true;
    }
    if (support::is_better(mode_, current - min_delta_, best_score_)) {
      reason = std::isfinite(best_score_)
                   ? fmt::format("Metric {} improved by {:.3f} >= min_delta = {}. New best score: {:.3f}", monitor_,
                                 std::abs(best_score_ - current), std::abs(min_delta_), current)
                   : fmt::format("Metric {} improved. New best score: {:.3f}", monitor_, current);
      best_score_ = current;
      wait_count_ = 0;
      return false;
    }
    ++wait_count_;
    if (wait_count_ >= patience_) {
      reason = fmt::format(
          "Monitored metric {} did not improve in the last {} records. Best score: {:.3f}. "
          "Signaling Trainer to stop.",
          monitor_, wait_count_, best_score_);
      return true;
    }
    return false;
  }

  void log(fulgur::TrainerContext& trainer, const std::string& message) const {
    const auto& cluster = trainer.cluster();
    if (cluster.world_size <= 1) {
      fulgur::log::info(message);
    } else if (!log_rank_zero_only_ || cluster.global_rank == 0) {
      fulgur::log::info(fmt::format("[rank: {}] {}", cluster.global_rank, message));
    }
  }

  // Options.
  std::string monitor_;
  MonitorMode mode_;
  int64_t patience_;
  double min_delta_;
  bool check_finite_;
  std::optional<double> stopping_threshold_;
  std::optional<double> divergence_threshold_;
  bool check_on_train_epoch_end_;
  bool strict_;
  bool verbose_;
  bool log_rank_zero_only_;

  // State.
  int64_t wait_count_ = 0;
  int64_t stopped_epoch_ = 0;
  double best_score_;
  bool fitting_ = false;
};

}  // namespace

FULGUR_PLUGIN(EarlyStopping, "early_stopping", "0.1.0",
              "Stops training when a monitored metric stops improving, crosses a threshold or is not finite")
