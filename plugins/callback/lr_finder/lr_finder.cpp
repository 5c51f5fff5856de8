// Built-in callback `lr_finder`: Lightning's LearningRateFinder. The learning-rate range test runs
// inside the fit's own first training steps (a callback cannot run steps of its own): before the
// first batch it copies the model's parameters and buffers and every optimizer's state; then each
// of num_training_steps optimizer steps uses the next lr of the sweep (set on every param group),
// and the step's loss goes into the sweep (lr_sweep.h). When the sweep ends (all steps, a diverging
// loss, or the end of the first epoch) it writes lr_find.csv and lr_find.png to the log directory,
// puts the weights and optimizer states back as they were, applies the suggestion to every param
// group of every optimizer (update_attr), and training goes on from the restored weights, or the
// run stops there (stop_after_sweep). The result is saved in checkpoints: a resumed run does not
// sweep again.
//
// What differs from Lightning (see also lr_sweep.h): the sweep's steps are real steps of the fit:
// they count in global_step and use the first batches of the first epoch (Lightning restores its
// loop counters from a checkpoint it writes before the sweep), step-interval lr schedulers are
// stepped during them, and a mid-epoch validation or checkpoint due during the sweep sees the
// sweep's weights. update_attr sets the optimizers' lr; there is no module attribute to set
// (attr_name is not offered). With several processes the step losses are averaged over the ranks,
// so every rank takes the same suggestion.
#include <fulgur/plugin.h>
#include <fulgur/state_dict.h>

#include "../common/callback_conventions.h"
#include "loss_plot.h"
#include "lr_sweep.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/scalar_tensor.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace support = fulgur::callback_conventions;
namespace lf = fulgur::lr_finder;
using fulgur::Error;
using fulgur::ErrorKind;

constexpr char kOwner[] = "callback 'lr_finder'";

class LrFinder final : public fulgur::CallbackBase<LrFinder> {
 public:
  FULGUR_OPTIONS(Options, (floating, min_lr, "The lr of the first sweep step", 1e-8),
                 (floating, max_lr, "The lr of the last sweep step", 1.0),
                 (integer, num_training_steps, "Optimizer steps (lrs tried) in the sweep", 100),
                 (string, mode, "\"exponential\" or \"linear\" growth of the lr from step to step", "exponential"),
                 (floating, early_stop_threshold,
                  "Stop the sweep when the smoothed loss exceeds this multiple of the best one; nan: never", 4.0),
                 (floating, beta, "Smoothing of the loss (exponential moving average; 0: none)", 0.98),
                 (integer, skip_begin, "Points left out at the start when choosing the suggestion", 10),
                 (integer, skip_end, "Points left out at the end when choosing the suggestion", 1),
                 (boolean, update_attr, "Set every optimizer param group's lr to the suggestion", true),
                 (boolean, stop_after_sweep, "Stop the run after the sweep (the weights are those from before it)",
                  false));

  explicit LrFinder(const Options& options)
      : sweep_options_(checked_options(options)),
        update_attr_(options.update_attr),
        stop_after_sweep_(options.stop_after_sweep) {}

  void on_fit_start(fulgur::TrainerContext&) override {
    sweep_.reset();
    snapshot_.reset();
  }

  void on_train_batch_start(fulgur::TrainerContext& trainer, const fulgur::Batch&, int64_t) override {
    if (done_) return;
    if (!sweep_) begin(trainer);
    set_lr(trainer, sweep_->next_lr());
  }

  void on_train_batch_end(fulgur::TrainerContext& trainer, const fulgur::StepOutput& output, const fulgur::Batch&,
                          int64_t) override {
    if (done_ || !sweep_) return;
    if (trainer.global_step() == last_step_) return;  // an accumulation micro-batch: no step yet
    last_step_ = trainer.global_step();
    at::Tensor loss = output.loss.defined() ? output.loss.detach().to(at::kDouble).reshape({})
                                            : at::scalar_tensor(std::nan(""), at::kDouble);
    if (trainer.cluster().world_size > 1)
      loss = trainer.reduce(loss.to(trainer.device()), fulgur::ReduceOp::mean).to(at::kCPU);
    const bool finished = sweep_->record(loss.item<double>());
    // The epoch's last batch ends the sweep too: its end-of-epoch validation and checkpoints must
    // see the restored weights.
    if (finished || trainer.is_last_batch()) finish(trainer);
  }

  std::string state_key() const override { return "LearningRateFinder"; }
  void state_dict(c10::IValue& out) const override {
    auto state = support::new_state_dict();
    state.insert("done", done_);
    state.insert("suggestion", suggestion_.value_or(std::nan("")));
    out = c10::IValue(state);
  }
  void load_state_dict(const c10::IValue& state) override {
    auto dict = support::expect_dict(kOwner, state);
    auto done = support::find_value(dict, "done");
    done_ = done && done->isBool() && done->toBool();
    auto suggestion = support::find_value(dict, "suggestion");
    if (suggestion && suggestion->isDouble() && !std::isnan(suggestion->toDouble()))
      suggestion_ = suggestion->toDouble();
  }

 private:
  static lf::SweepMode parse_mode(const Options& o) {
    if (o.mode == "exponential") return lf::SweepMode::exponential;
    if (o.mode == "linear") return lf::SweepMode::linear;
    o.reject("mode",
             "is not understood; use \"exponential\" (the lr grows by the same factor each step) or \"linear\"");
  }

  static lf::LrSweepOptions checked_options(const Options& o) {
    auto options = lf::LrSweepOptions()
                       .min_lr(o.min_lr)
                       .max_lr(o.max_lr)
                       .num_training_steps(o.num_training_steps)
                       .mode(parse_mode(o))
                       .early_stop_threshold(o.early_stop_threshold)
                       .beta(o.beta)
                       .skip_begin(o.skip_begin)
                       .skip_end(o.skip_end);
    o.check(options.min_lr_ > 0, "min_lr", "must be > 0");
    o.check(options.max_lr_ > options.min_lr_, "max_lr",
            fmt::format("must be greater than min_lr = {}", options.min_lr_));
    o.check(options.num_training_steps_ >= 2, "num_training_steps", "must be >= 2 (the lrs tried)");
    o.check(std::isnan(options.early_stop_threshold_) || options.early_stop_threshold_ > 1.0, "early_stop_threshold",
            "must be > 1 (the sweep stops when the smoothed loss exceeds this multiple of the best one), or nan to "
            "never stop early");
    o.check(options.beta_ >= 0.0 && options.beta_ < 1.0, "beta", "must lie in [0, 1) (0: no smoothing)");
    o.check(options.skip_begin_ >= 0 && options.skip_end_ >= 0, "skip_begin",
            fmt::format("and skip_end = {} must be >= 0", options.skip_end_));
    if (options.skip_begin_ + options.skip_end_ + 2 > options.num_training_steps_)
      throw Error(ErrorKind::config,
                  fmt::format("{}: skip_begin + skip_end = {} leaves fewer than 2 of num_training_steps = {} points "
                              "for the suggestion; lower them or raise num_training_steps",
                              kOwner, options.skip_begin_ + options.skip_end_, options.num_training_steps_));
    return options;
  }

  struct Snapshot {
    c10::IValue model;
    std::vector<c10::IValue> optimizers;
  };

  void begin(fulgur::TrainerContext& trainer) {
    if (trainer.optimizers().empty())
      throw Error(ErrorKind::config, fmt::format("{}: the module has no optimizer whose lr could be swept; remove "
                                                 "the callback or return an optimizer from configure_optimizers",
                                                 kOwner));
    Snapshot snapshot;
    // deepcopy: the live tensors are updated in place by the sweep's steps.
    snapshot.model = fulgur::module_state_dict(trainer.model()).deepcopy();
    for (auto* optimizer : trainer.optimizers())
      snapshot.optimizers.push_back(fulgur::optimizer_state_dict(*optimizer).deepcopy());
    snapshot_ = std::move(snapshot);
    sweep_.emplace(sweep_options_);
    last_step_ = trainer.global_step();
    fulgur::log::info(fmt::format("{}: sweeping the lr from {} to {} over {} steps ({})", kOwner,
                                  sweep_options_.min_lr_, sweep_options_.max_lr_, sweep_options_.num_training_steps_,
                                  sweep_options_.mode_ == lf::SweepMode::exponential ? "exponential" : "linear"));
  }

  static void set_lr(fulgur::TrainerContext& trainer, double lr) {
    for (auto* optimizer : trainer.optimizers())
      for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
  }

  void finish(fulgur::TrainerContext& trainer) {
    done_ = true;
    const auto& points = sweep_->points();
    if (sweep_->diverged())
      fulgur::log::info(
          fmt::format("{}: the sweep stopped after {} steps: the smoothed loss exceeded early_stop_threshold = {} "
                      "times the best one",
                      kOwner, points.size(), sweep_options_.early_stop_threshold_));
    else if (static_cast<int64_t>(points.size()) < sweep_options_.num_training_steps_)
      fulgur::log::warn(
          fmt::format("{}: the first epoch had only {} training steps, fewer than num_training_steps = {}; the sweep "
                      "ended with the epoch (lower num_training_steps or raise limit_train_batches)",
                      kOwner, points.size(), sweep_options_.num_training_steps_));
    const auto index = sweep_->suggestion_index();
    if (index) suggestion_ = points[*index].lr;
    // Restored before the files are written: a failed write must not leave the sweep's weights.
    restore(trainer);
    if (trainer.is_global_zero()) write_results(trainer, index);
    if (!index)
      fulgur::log::error(
          fmt::format("{}: no lr suggested: fewer than 2 finite losses remained after skip_begin = {} and skip_end = "
                      "{}; the optimizers keep their lr",
                      kOwner, sweep_options_.skip_begin_, sweep_options_.skip_end_));
    else if (update_attr_)
      set_lr(trainer, *suggestion_);
    if (index) {
      fulgur::log::info(
          fmt::format("{}: suggested lr {}{}", kOwner, *suggestion_,
                      update_attr_ ? "; the optimizers use it from now on" : " (update_attr = false: not applied)"));
      if (trainer.has_logger()) trainer.log_metrics({{"lr_finder/suggestion", *suggestion_}}, kOwner);
    }
    sweep_.reset();
    if (stop_after_sweep_) trainer.request_stop("lr_finder: stop_after_sweep = true");
  }

  // The weights and optimizer states from before the sweep, with their lrs.
  void restore(fulgur::TrainerContext& trainer) {
    at::NoGradGuard no_grad;
    fulgur::load_module_state_dict(trainer.model(), snapshot_->model, /*strict=*/true, kOwner);
    auto optimizers = trainer.optimizers();
    for (size_t i = 0; i < optimizers.size(); ++i) {
      // Loading leaves alone the state of parameters that had none before the sweep: drop it all first.
      optimizers[i]->state().clear();
      fulgur::load_optimizer_state_dict(*optimizers[i], snapshot_->optimizers[i], kOwner);
      optimizers[i]->zero_grad(/*set_to_none=*/true);
    }
    snapshot_.reset();
  }

  void write_results(fulgur::TrainerContext& trainer, std::optional<size_t> index) const {
    const std::filesystem::path dir = trainer.log_dir();
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const auto& points = sweep_->points();
    const std::filesystem::path csv = dir / "lr_find.csv";
    {
      std::ofstream out(csv);
      out << "step,lr,loss,smoothed_loss,suggested\n";
      for (size_t i = 0; i < points.size(); ++i)
        out << fmt::format("{},{},{},{},{}\n", i, points[i].lr, points[i].loss, points[i].smoothed_loss,
                           index && *index == i ? 1 : 0);
      if (!out)
        throw Error(ErrorKind::io,
                    fmt::format("{}: cannot write {}; check that the log directory is writable", kOwner, csv.string()));
    }
    const std::filesystem::path png = dir / "lr_find.png";
    lf::write_loss_plot(png.string(), points, index,
                        lf::LossPlotOptions().log_x(sweep_options_.mode_ == lf::SweepMode::exponential));
    fulgur::log::info(fmt::format("{}: wrote {} and {}", kOwner, csv.string(), png.string()));
  }

  lf::LrSweepOptions sweep_options_;
  bool update_attr_;
  bool stop_after_sweep_;
  bool done_ = false;
  std::optional<double> suggestion_;
  std::optional<lf::LrSweep> sweep_;
  std::optional<Snapshot> snapshot_;
  int64_t last_step_ = 0;
};

}  // namespace

FULGUR_PLUGIN(LrFinder, "lr_finder", "0.1.0",
              "Learning-rate range test in the first training steps (Lightning's LearningRateFinder): writes "
              "lr_find.csv and lr_find.png, restores the weights and applies the suggested lr")
