// Built-in callback `spike_detection`: Lightning's SpikeDetection. It keeps a running mean of the
// last `window` training losses and calls a loss a spike when it is worse than that mean by at
// least atol (absolute) and rtol (relative to the mean), or, with finite_only, when it is not
// finite. The spiking batch index is appended to exclude_batches_path (skip_batches.json, as
// Lightning writes it) and then, by `action`:
//   warn  - log a warning and go on;
//   skip  - the optimizer step of that batch does not happen: the decision is taken in
//           on_before_optimizer_step and every gradient of the optimizer is dropped (set to
//           undefined), which torch::optim's SGD, Adam, AdamW, RMSprop and Adagrad skip, so no
//           weight and no optimizer state (momentum, Adam's moments and step count) changes.
//           The Trainer still counts the step (global_step) and steps its lr schedulers: the
//           contract gives callbacks no way to cancel a step;
//   raise - stop the run with an error naming the batch (Lightning's TrainingSpikeException).
// Spikes are kept out of the running mean. Unlike Lightning, which checks after the step in
// on_train_batch_end, the check runs before the step, so `raise` also never applies a spike.
// With several processes the loss is averaged over the ranks first, so all decide alike.
#include <fulgur/plugin.h>

#include "../common/callback_conventions.h"

#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
using fulgur::Error;
using fulgur::ErrorKind;
using support::MonitorMode;

constexpr char kOwner[] = "callback 'spike_detection'";

enum class Action { warn, skip, raise };

Action parse_action(const fulgur::PluginOptions& options, const std::string& action) {
  if (action == "warn") return Action::warn;
  if (action == "skip") return Action::skip;
  if (action == "raise") return Action::raise;
  options.reject("action",
                 "is not understood; use \"warn\" (log and go on), \"skip\" (drop that optimizer step) or \"raise\" "
                 "(stop with an error)");
}

std::optional<double> optional_tolerance(const fulgur::PluginOptions& options, const char* key, double value) {
  if (std::isnan(value)) return std::nullopt;
  options.check(value >= 0, key, "must be >= 0 (nan: no condition)");
  return value;
}

class SpikeDetection final : public fulgur::CallbackBase<SpikeDetection> {
 public:
  FULGUR_OPTIONS(Options, (string, action, "\"warn\", \"skip\" (drop that optimizer step) or \"raise\"", "raise"),
                 (string, mode, "\"min\": a loss above the mean is worse; \"max\": below", "min"),
                 (integer, window, "Number of recent losses in the running mean", 10),
                 (integer, warmup, "Losses observed before the first check", 1),
                 (floating, atol, "Least absolute distance from the mean for a spike; nan: no condition", nan),
                 (floating, rtol, "Least distance from the mean, relative to the mean, for a spike; nan: no condition",
                  2.0),
                 (string, exclude_batches_path,
                  "Where skip_batches.json goes (a .json file or a directory); \"\": default_root_dir", ""),
                 (boolean, finite_only,
                  "A non-finite loss (nan, inf) counts as a spike; false: it is only kept out of the mean", true));

  explicit SpikeDetection(const Options& options)
      : mode_(support::parse_mode(kOwner, options.mode)),
        window_(options.window),
        warmup_(options.warmup),
        atol_(optional_tolerance(options, "atol", options.atol)),
        rtol_(optional_tolerance(options, "rtol", options.rtol)),
        exclude_path_(options.exclude_batches_path),
        finite_only_(options.finite_only),
        action_(parse_action(options, options.action)) {
    options.check(window_ >= 1, "window", "must be >= 1");
    options.check(warmup_ >= 0, "warmup", "must be >= 0");
  }

  void on_train_batch_start(fulgur::TrainerContext&, const fulgur::Batch&, int64_t batch_idx) override {
    batch_idx_ = batch_idx;
  }

  // The loss that is about to be back-propagated (divided by accumulate_grad_batches when
  // accumulating, so the sum over the window is the window's mean loss).
  void on_before_backward(fulgur::TrainerContext&, const at::Tensor& loss) override {
    at::NoGradGuard no_grad;
    at::Tensor value = loss.detach();
    pending_loss_ = pending_loss_.defined() ? pending_loss_.add(value) : value.clone();
  }

  void on_before_optimizer_step(fulgur::TrainerContext& trainer, torch::optim::Optimizer& optimizer) override {
    if (!pending_loss_.defined()) return;  // a second optimizer of a manual step: judged already
    at::Tensor loss = pending_loss_;
    pending_loss_ = at::Tensor();
    if (trainer.cluster().world_size > 1) loss = trainer.reduce(loss, fulgur::ReduceOp::mean);
    const double value = loss.item<double>();  // one host sync per step, inherent to the check
    const bool spike = seen_ >= warmup_ && is_spike(value);
    ++seen_;
    if (!spike) {
      if (std::isfinite(value)) remember(value);
      return;
    }
    handle_spike(trainer, optimizer, value);
  }

  std::string state_key() const override { return "SpikeDetection"; }
  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    state.insert("window_values", c10::List<double>(std::vector<double>(values_.begin(), values_.end())));
    state.insert("bad_batches", c10::List<int64_t>(bad_batches_));
    state.insert("seen", seen_);
    out = c10::IValue(state);
  }
  void load_state_dict(const c10::IValue& state) override {
    const auto dict = support::expect_dict(kOwner, state);
    values_.clear();
    if (auto v = support::find_value(dict, "window_values"); v && v->isDoubleList())
      for (double x : v->toDoubleVector()) values_.push_back(x);
    bad_batches_.clear();
    if (auto v = support::find_value(dict, "bad_batches"); v && v->isIntList()) bad_batches_ = v->toIntVector();
    seen_ = support::get_optional_int(kOwner, dict, "seen").value_or(0);
  }

 private:
  void remember(double value) {
    values_.push_back(value);
    while (static_cast<int64_t>(values_.size()) > window_) values_.pop_front();
  }

  bool is_spike(double loss) const {
    if (!std::isfinite(loss)) return finite_only_;
    if (values_.empty()) return false;
    double mean = 0;
    for (double v : values_) mean += v;
    mean /= static_cast<double>(values_.size());
    const double diff = loss - mean;
    // Better than (or equal to) the running mean is never a spike.
    if (mode_ == MonitorMode::min ? diff <= 0.0 : diff >= 0.0) return false;
    const bool atol_hit = !atol_ || std::abs(diff) >= *atol_;
    const bool rtol_hit = !rtol_ || std::abs(diff) >= *rtol_ * std::abs(mean);
    return atol_hit && rtol_hit;
  }

  std::string exclude_file(fulgur::TrainerContext& trainer) const {
    std::filesystem::path path = exclude_path_.empty() ? std::filesystem::path(trainer.default_root_dir())
                                                       : std::filesystem::path(exclude_path_);
    if (path.extension() != ".json") path /= "skip_batches.json";
    return path.string();
  }

  void handle_spike(fulgur::TrainerContext& trainer, torch::optim::Optimizer& optimizer, double loss) {
    bad_batches_.push_back(batch_idx_);
    if (trainer.is_global_zero()) write_bad_batches(exclude_file(trainer));
    const std::string what = fmt::format(
        "{}: loss spike at epoch {}, batch {} (global step {}): loss {} against a "
        "running mean of the last {} losses",
        kOwner, trainer.current_epoch(), batch_idx_, trainer.global_step(), support::python_float_repr(loss),
        values_.size());
    switch (action_) {
      case Action::warn:
        fulgur::log::warn(what);
        return;
      case Action::skip: {
        at::NoGradGuard no_grad;
        for (auto& group : optimizer.param_groups())
          for (auto& param : group.params())
            if (param.grad().defined()) param.mutable_grad() = at::Tensor();
        fulgur::log::warn(fmt::format("{}; the optimizer step of this batch is skipped", what));
        return;
      }
      case Action::raise:
        throw Error(ErrorKind::runtime,
                    fmt::format("{}. The batch index is recorded in {}; lower the learning rate, clip gradients, "
                                "or use action = \"skip\"",
                                what, exclude_file(trainer)));
    }
  }

  // Lightning's skip_batches.json: a JSON list of the batch indices that spiked, rewritten whole.
  void write_bad_batches(const std::string& path) const {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << "[";
      for (size_t i = 0; i < bad_batches_.size(); ++i) out << (i ? ",\n    " : "\n    ") << bad_batches_[i];
      out << (bad_batches_.empty() ? "]" : "\n]") << "\n";
      if (!out)
        throw Error(ErrorKind::io, fmt::format("{}: cannot write {}; check the directory's permissions or set "
                                               "exclude_batches_path",
                                               kOwner, tmp));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      throw Error(ErrorKind::io, fmt::format("{}: cannot rename {} to {}", kOwner, tmp, path));
  }

  MonitorMode mode_;
  int64_t window_;
  int64_t warmup_;
  std::optional<double> atol_;
  std::optional<double> rtol_;
  std::string exclude_path_;
  bool finite_only_;
  Action action_;
  std::deque<double> values_;
  std::vector<int64_t> bad_batches_;
  int64_t seen_ = 0;
  int64_t batch_idx_ = 0;
  at::Tensor pending_loss_;
};

}  // namespace

FULGUR_PLUGIN(SpikeDetection, "spike_detection", "0.1.0",
              "Detects training-loss spikes against a running mean (Lightning's SpikeDetection) and warns, skips "
              "the optimizer step or raises")
