// fulgur::Module — the LightningModule of Fulgur: a torch::nn::Module that also says how to train,
// evaluate and predict, which optimizers to use, and what to log.
//
//   struct Net : fulgur::Module {
//     explicit Net(const fulgur::Options& hp) : lr(hp.get_float("lr")) {
//       fc = register_module("fc", torch::nn::Linear(784, 10));
//     }
//     fulgur::StepOutput training_step(const fulgur::Batch& b, int64_t) override {
//       auto loss = torch::nn::functional::cross_entropy(fc->forward(b.input.flatten(1)), b.target);
//       log("train/loss", loss, fulgur::LogOptions().prog_bar(true));
//       return {loss};
//     }
//     std::vector<fulgur::OptimizerConfig> configure_optimizers() override {
//       return {fulgur::OptimizerConfig(std::make_shared<torch::optim::Adam>(parameters(), lr))};
//     }
//     torch::nn::Linear fc{nullptr};
//     double lr;
//   };
#pragma once

#include <fulgur/lr_scheduler.h>
#include <fulgur/options.h>
#include <fulgur/types.h>

#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fulgur {

class MetricStore;
namespace metrics {
class Metric;
}

enum class Reduction { mean, sum, max, min };

// How a value passed to Module::log is aggregated and where it goes (Lightning's self.log flags).
struct LogOptions {
  // on_step / on_epoch default like Lightning: step-level in training, epoch-level in evaluation.
  LogOptions& on_step(bool v) {
    on_step_ = v;
    return *this;
  }
  LogOptions& on_epoch(bool v) {
    on_epoch_ = v;
    return *this;
  }
  LogOptions& prog_bar(bool v) {
    prog_bar_ = v;
    return *this;
  }
  LogOptions& logger(bool v) {
    logger_ = v;
    return *this;
  }
  LogOptions& reduce(Reduction v) {
    reduce_ = v;
    return *this;
  }
  LogOptions& sync_dist(bool v) {
    sync_dist_ = v;
    return *this;
  }
  LogOptions& batch_size(int64_t v) {
    batch_size_ = v;
    return *this;
  }

  std::optional<bool> on_step_;
  std::optional<bool> on_epoch_;
  bool prog_bar_ = false;
  bool logger_ = true;
  Reduction reduce_ = Reduction::mean;
  bool sync_dist_ = false;
  std::optional<int64_t> batch_size_;  // default: the current batch's size
};

enum class SchedulerInterval { step, epoch };

// One optimizer with an optional scheduler (Lightning's dict form of configure_optimizers).
struct OptimizerConfig {
  OptimizerConfig() = default;
  explicit OptimizerConfig(std::shared_ptr<torch::optim::Optimizer> optimizer) : optimizer(std::move(optimizer)) {}
  OptimizerConfig& with_scheduler(std::shared_ptr<LRScheduler> s, SchedulerInterval i = SchedulerInterval::epoch,
                                  int64_t f = 1, std::string m = {}) {
    scheduler = std::move(s);
    interval = i;
    frequency = f;
    monitor = std::move(m);
    return *this;
  }

  std::shared_ptr<torch::optim::Optimizer> optimizer;
  std::shared_ptr<LRScheduler> scheduler;
  SchedulerInterval interval = SchedulerInterval::epoch;
  int64_t frequency = 1;
  std::string monitor;  // metric for reduce-on-plateau schedulers
};

class Module;

// One of the Module's optimizers as training_step drives it under manual optimization (Lightning's
// LightningOptimizer). step() goes through the Trainer exactly as automatic optimization does:
// the precision plugin unscales the gradients, on_before_optimizer_step runs (callbacks, then the
// Module), then the strategy steps through the precision plugin, which skips the step when the
// gradients hold inf/NaN and updates the loss scale (16-mixed). Stepping optimizer() directly
// would bypass all of that, which is why the handle does not forward `->`.
//
//   auto opt = optimizer();
//   opt.zero_grad();
//   manual_backward(loss);
//   clip_gradients(opt, 1.0);  // optional; acts on unscaled gradients
//   opt.step();
class OptimizerHandle {
 public:
  OptimizerHandle(const Module& module, torch::optim::Optimizer& optimizer)
      : module_(&module), optimizer_(&optimizer) {}

  // Returns whether the optimizer stepped (false: skipped for inf/NaN gradients).
  bool step();
  // Plain torch zero_grad (Lightning calls no hook here under manual optimization).
  void zero_grad(bool set_to_none = true);
  // The torch optimizer, for its param_groups() and state; do not step() it directly.
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }

 private:
  const Module* module_;
  torch::optim::Optimizer* optimizer_;
};

class Module : public torch::nn::Module {
 public:
  Module();
  ~Module() override;

  // Steps. training_step must return a loss (automatic optimization) unless manual optimization
  // is on; the others may return an empty StepOutput.
  virtual StepOutput training_step(const Batch& batch, int64_t batch_idx) = 0;
  virtual StepOutput validation_step(const Batch& batch, int64_t batch_idx);
  virtual StepOutput test_step(const Batch& batch, int64_t batch_idx);
  // With several validation/test loaders (DataModule::val_loaders): the loader's index too. By
  // default these call the two-argument steps, so a module with one loader overrides those.
  virtual StepOutput validation_step(const Batch& batch, int64_t batch_idx, int64_t dataloader_idx);
  virtual StepOutput test_step(const Batch& batch, int64_t batch_idx, int64_t dataloader_idx);
  virtual at::Tensor predict_step(const Batch& batch, int64_t batch_idx);
  virtual std::vector<OptimizerConfig> configure_optimizers() = 0;
  // Lightning's configure_model: create layers here instead of in the constructor to let the
  // strategy build them (a sharded strategy materialises only its shards). Runs under the
  // strategy at the start of every stage, before configure_optimizers: keep it idempotent
  // (return early when the layers exist).
  virtual void configure_model() {}

  // Data hooks, in Lightning's order: on_before_batch_transfer, transfer_batch_to_device,
  // on_after_batch_transfer.
  virtual Batch on_before_batch_transfer(Batch batch) { return batch; }
  virtual Batch transfer_batch_to_device(Batch batch, const c10::Device& device);
  virtual Batch on_after_batch_transfer(Batch batch) { return batch; }

  // Module-level hooks (a subset of Lightning's, called in its order; see hook-order test).
  virtual void on_fit_start() {}
  virtual void on_fit_end() {}
  virtual void on_train_start() {}
  virtual void on_train_end() {}
  virtual void on_train_epoch_start() {}
  virtual void on_train_epoch_end() {}
  virtual void on_validation_epoch_start() {}
  virtual void on_validation_epoch_end() {}
  virtual void on_test_epoch_start() {}
  virtual void on_test_epoch_end() {}
  virtual void on_train_batch_start(const Batch&, int64_t) {}
  virtual void on_train_batch_end(const StepOutput&, const Batch&, int64_t) {}
  virtual void on_before_backward(const at::Tensor&) {}
  virtual void on_after_backward() {}
  virtual void on_before_optimizer_step(torch::optim::Optimizer&) {}
  virtual void on_before_zero_grad(torch::optim::Optimizer&) {}

  // Logging (Lightning's self.log). Tensors are detached and stay on device; nothing is copied
  // to the host until a logger, the progress bar or a monitor needs the value.
  void log(const std::string& name, const at::Tensor& value, const LogOptions& options = {});
  void log(const std::string& name, double value, const LogOptions& options = {});
  void log_dict(const std::map<std::string, at::Tensor>& values, const LogOptions& options = {});
  // A metric object (the Metric base is fulgur/metric.h; concrete metrics are in fulgur/metrics.h),
  // as Lightning logs a torchmetrics object: at the end of the epoch the Trainer calls
  // metric.compute() (synchronised across ranks through this Module unless the metric was given its
  // own sync) and then metric.reset(). Update the metric in the step yourself; log it from the step
  // (every call after the first only marks it as due). The value is epoch-level only (on_step(true)
  // is refused: log a tensor for per-step values) and must be a scalar. The metric must outlive the
  // epoch (make it a member).
  void log(const std::string& name, metrics::Metric& metric, const LogOptions& options = {});

  // Manual optimization: training_step calls manual_backward and steps the optimizers itself
  // through the handles optimizers() returns (see OptimizerHandle). Trainer-level
  // gradient_clip_val is refused then, as in Lightning; call clip_gradients instead.
  bool automatic_optimization = true;
  void manual_backward(const at::Tensor& loss);
  // The optimizers configure_optimizers() returned, in order (empty outside a Trainer run).
  std::vector<OptimizerHandle> optimizers() const;
  // optimizers()[index] without building the vector; throws if there is no such optimizer.
  OptimizerHandle optimizer(size_t index = 0) const;
  // Lightning's self.clip_gradients: clips the optimizer's gradients now, through the precision
  // plugin (16-mixed unscales them first). clip_value <= 0 does nothing.
  void clip_gradients(const OptimizerHandle& optimizer, double clip_value,
                      GradClipAlgorithm algorithm = GradClipAlgorithm::norm);

  // The extension interface named `id` that this Module implements, or nullptr (the default).
  // Capabilities added after SDK 1.0 arrive this way (fulgur/extension.h). Must not throw.
  virtual void* extension(std::string_view id) noexcept;

  // Hyperparameters from the TOML [model] table (set before construction-time use by the Trainer
  // when built through fulgur::run, or by the user).
  Options hparams;

  // Trainer wiring (not for users).
  struct Binding;
  Binding* binding() const { return binding_; }
  void bind(Binding* binding) { binding_ = binding; }

 private:
  Binding* binding_ = nullptr;
};

}  // namespace fulgur
