// Built-in callback `lr_monitor`: Lightning's LearningRateMonitor. Logs every optimizer's learning
// rate per parameter group to the loggers, under Lightning's names: "lr-Adam" for a single group,
// "lr-Adam/pg1", "lr-Adam/pg2" for several, "lr-Adam-1" for a second Adam; optionally momentum
// ("lr-Adam-momentum": beta1 for Adam-like optimizers) and weight decay ("lr-Adam-weight_decay").
// A scheduler the model named (fulgur::with_scheduler_keys, Lightning's lr_scheduler_config["name"])
// gives its optimizer that name instead of "lr-<Optimizer>" (SDK 1.3's SchedulerNames extension).
#include <fulgur/plugin.h>
#include <fulgur/scheduler_names.h>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cxxabi.h>
#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "../common/direct_logging.h"

namespace {

namespace monitor = fulgur::direct_logging;
namespace optim = torch::optim;

constexpr char kOwner[] = "callback 'lr_monitor'";

// "torch::optim::Adam" -> "Adam": the class name, as Python's optimizer.__class__.__name__.
std::string class_name(const optim::Optimizer& optimizer) {
  const char* mangled = typeid(optimizer).name();
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  std::string name = status == 0 && demangled ? demangled.get() : mangled;
  if (const size_t colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
  return name;
}

// Momentum as Lightning reads it: beta1 where the optimizer has betas, else `momentum`.
std::optional<double> momentum_of(const optim::OptimizerOptions& o) {
  if (auto* adam = dynamic_cast<const optim::AdamOptions*>(&o)) return std::get<0>(adam->betas());
  if (auto* adamw = dynamic_cast<const optim::AdamWOptions*>(&o)) return std::get<0>(adamw->betas());
  if (auto* sgd = dynamic_cast<const optim::SGDOptions*>(&o)) return sgd->momentum();
  if (auto* rms = dynamic_cast<const optim::RMSpropOptions*>(&o)) return rms->momentum();
  return std::nullopt;
}

std::optional<double> weight_decay_of(const optim::OptimizerOptions& o) {
  if (auto* adam = dynamic_cast<const optim::AdamOptions*>(&o)) return adam->weight_decay();
  if (auto* adamw = dynamic_cast<const optim::AdamWOptions*>(&o)) return adamw->weight_decay();
  if (auto* sgd = dynamic_cast<const optim::SGDOptions*>(&o)) return sgd->weight_decay();
  if (auto* rms = dynamic_cast<const optim::RMSpropOptions*>(&o)) return rms->weight_decay();
  if (auto* adagrad = dynamic_cast<const optim::AdagradOptions*>(&o)) return adagrad->weight_decay();
  return std::nullopt;
}

class LearningRateMonitor final : public fulgur::Callback {
 public:
  FULGUR_OPTIONS(Options,
                 (string, logging_interval,
                  "\"step\": on the Trainer's logging steps (log_every_n_steps); \"epoch\": at each epoch "
                  "start",
                  "step"),
                 (boolean, log_momentum, "Also log momentum (beta1 for Adam-like optimizers)", false),
                 (boolean, log_weight_decay, "Also log weight decay", false));
  explicit LearningRateMonitor(const Options& options)
      : interval_(options.logging_interval),
        log_momentum_(options.log_momentum),
        log_weight_decay_(options.log_weight_decay) {
    options.check(interval_ == "step" || interval_ == "epoch", "logging_interval",
                  "is not understood; use \"step\" (every log_every_n_steps) or \"epoch\"");
  }

  fulgur::HookSet hooks() const override {
    return fulgur::Hook::train_start | fulgur::Hook::train_epoch_start | fulgur::Hook::train_batch_start;
  }

  void on_train_start(fulgur::TrainerContext& trainer) override {
    monitor::require_logger(trainer, kOwner);
    names_.clear();
    // A scheduler's own name (Lightning's lr_scheduler_config["name"]) replaces "lr-<Optimizer>"
    // where the host says it (SDK 1.3).
    std::vector<std::string> scheduler_names;
    if (auto* named = fulgur::find_extension<fulgur::SchedulerNames>(trainer))
      scheduler_names = named->scheduler_names();
    std::map<std::string, int> seen;  // class name -> optimizers of that class so far
    const std::vector<optim::Optimizer*> optimizers = trainer.optimizers();
    for (size_t i = 0; i < optimizers.size(); ++i) {
      optim::Optimizer* optimizer = optimizers[i];
      const std::string type = class_name(*optimizer);
      const int index = seen[type]++;
      const std::string given = i < scheduler_names.size() ? scheduler_names[i] : std::string();
      const std::string base = !given.empty() ? given
                               : index == 0   ? fmt::format("lr-{}", type)
                                              : fmt::format("lr-{}-{}", type, index);
      std::vector<std::string> groups;
      const size_t n = optimizer->param_groups().size();
      for (size_t g = 0; g < n; ++g) groups.push_back(n == 1 ? base : fmt::format("{}/pg{}", base, g + 1));
      names_.push_back(std::move(groups));
    }
  }

  void on_train_epoch_start(fulgur::TrainerContext& trainer) override {
    if (interval_ == "epoch") log(trainer);
  }

  void on_train_batch_start(fulgur::TrainerContext& trainer, const fulgur::Batch&, int64_t) override {
    if (interval_ == "step" && trainer.step_logging_due()) log(trainer);
  }

 private:
  // At an epoch's start the row goes out at the steps taken so far; within a batch it joins the
  // Trainer's row for that batch (the learning rate the step will use).
  void log(fulgur::TrainerContext& trainer) {
    stats_.clear();
    const std::vector<optim::Optimizer*> optimizers = trainer.optimizers();
    for (size_t i = 0; i < optimizers.size() && i < names_.size(); ++i) {
      const auto& groups = optimizers[i]->param_groups();
      for (size_t g = 0; g < groups.size() && g < names_[i].size(); ++g) {
        const optim::OptimizerOptions& o = groups[g].options();
        const std::string& name = names_[i][g];
        stats_[name] = o.get_lr();
        if (log_momentum_) stats_[name + "-momentum"] = momentum_of(o).value_or(0.0);
        if (log_weight_decay_)
          if (auto wd = weight_decay_of(o)) stats_[name + "-weight_decay"] = *wd;
      }
    }
    trainer.log_metrics(stats_, kOwner);
  }

  std::string interval_;
  bool log_momentum_;
  bool log_weight_decay_;
  std::vector<std::vector<std::string>> names_;  // per optimizer, per param group
  fulgur::MetricMap stats_;
};

}  // namespace

FULGUR_PLUGIN(LearningRateMonitor, "lr_monitor", "0.1.0",
              "Logs each optimizer's learning rate per parameter group (Lightning's LearningRateMonitor)")
