#include <fulgur/error.h>
#include <fulgur/metric.h>
#include <fulgur/module.h>
#include <fulgur/precision.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/optim/optimizer.h>

#include <cmath>

#include "binding.h"

namespace fulgur {

Module::Module() = default;
Module::~Module() = default;
void* Module::extension(std::string_view) noexcept { return nullptr; }

StepOutput Module::validation_step(const Batch&, int64_t) { return {}; }
StepOutput Module::test_step(const Batch&, int64_t) { return {}; }
StepOutput Module::validation_step(const Batch& batch, int64_t batch_idx, int64_t) {
  return validation_step(batch, batch_idx);
}
StepOutput Module::test_step(const Batch& batch, int64_t batch_idx, int64_t) { return test_step(batch, batch_idx); }
at::Tensor Module::predict_step(const Batch&, int64_t) {
  throw Error(ErrorKind::invalid_argument,
              fmt::format("{} does not override predict_step(); implement it to use Trainer::predict", name()));
}

Batch Module::transfer_batch_to_device(Batch batch, const c10::Device& device) {
  if (batch.input.defined() && batch.input.device() != device)
    batch.input = batch.input.to(device, /*non_blocking=*/true);
  if (batch.target.defined() && batch.target.device() != device)
    batch.target = batch.target.to(device, /*non_blocking=*/true);
  for (auto& t : batch.extra)
    if (t.defined() && t.device() != device) t = t.to(device, /*non_blocking=*/true);
  return batch;
}

namespace {

// Lightning raises when self.log is called where logging is not allowed (predict, setup,
// configure_optimizers, on_fit_start/end, on_train_end, ...); a dropped value would be silent.
// Errors from a hook call name the hook already (hook_dispatcher.h); `log_hook` names the others.
void require_logging_allowed(const Module::Binding& binding, const std::string& name) {
  if (binding.logging_allowed) return;
  throw Error(
      ErrorKind::invalid_argument,
      fmt::format("log('{}') was called {}where logging is not allowed (as in Lightning: only the "
                  "training, validation and test steps, their batch and epoch hooks, on_train_start and "
                  "the backward and optimizer hooks may log)",
                  name, binding.log_hook ? fmt::format("in {}, ", binding.log_hook) : std::string("in a hook ")));
}

// barebones = true: logging costs time, so it is off; the first call says so (Lightning warns too).
bool logging_disabled(Module::Binding& binding) {
  if (!binding.barebones) return false;
  if (!binding.warned_barebones)
    spdlog::warn("log() is called but [trainer] barebones = true: logging can slow training down, so it is off");
  binding.warned_barebones = true;
  return true;
}

// Where log(name) goes: nullptr when nothing is logged (outside a Trainer run, barebones); throws
// where Lightning forbids logging.
MetricStore* log_target(Module::Binding* binding, const std::string& name) {
  if (!binding || logging_disabled(*binding)) return nullptr;
  require_logging_allowed(*binding, name);
  return binding->metrics;
}

}  // namespace

void Module::log(const std::string& name, const at::Tensor& value, const LogOptions& options) {
  if (!log_target(binding_, name)) return;
  std::string full_name = binding_->name_suffix.empty() ? name : name + binding_->name_suffix;
  if (binding_->recorded_logs) {  // the step is being captured: the value is logged after each replay
    if (value.device() != binding_->recording_device)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("log('{}') inside a captured training step (cuda_graphs) logs a value on {} (a host "
                              "number), which a replay cannot update; log a tensor the step computes on {}, or log "
                              "it from a hook outside the step",
                              name, value.device().str(), binding_->recording_device.str()));
    binding_->recorded_logs->push_back(RecordedLog{std::move(full_name), value.detach(), options});
    return;
  }
  binding_->metrics->log(full_name, value, options, binding_->training_context, binding_->batch_size,
                         binding_->strategy);
}

void Module::log(const std::string& name, double value, const LogOptions& options) {
  log(name, at::scalar_tensor(value, at::kDouble), options);
}

void Module::log(const std::string& name, metrics::Metric& metric, const LogOptions& options) {
  if (!log_target(binding_, name)) return;
  if (options.on_step_.value_or(false) || !options.on_epoch_.value_or(true))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("log('{}', metric): metric objects are logged once per epoch (compute() at its end); for a "
                            "per-step value log a tensor, e.g. the batch's own value",
                            name));
  if (binding_->recorded_logs)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("log('{}', metric) inside a captured training step (cuda_graphs): the metric's update() "
                            "would be recorded into the graph with state tensors its reset() replaces; log the "
                            "batch's value as a tensor, or set cuda_graphs = \"off\"",
                            name));
  if (!metric.synced()) metric.sync_with(*this);
  binding_->metrics->log_metric(binding_->name_suffix.empty() ? name : name + binding_->name_suffix, metric, options);
}

void Module::log_dict(const std::map<std::string, at::Tensor>& values, const LogOptions& options) {
  for (const auto& [k, v] : values) log(k, v, options);
}

void Module::manual_backward(const at::Tensor& loss) {
  if (!binding_ || !binding_->manual_backward)
    throw Error(ErrorKind::invalid_argument, "manual_backward() needs a running Trainer");
  binding_->manual_backward(loss);
}

std::vector<OptimizerHandle> Module::optimizers() const {
  std::vector<OptimizerHandle> handles;
  if (binding_)
    for (torch::optim::Optimizer* optimizer : binding_->optimizers) handles.emplace_back(*this, *optimizer);
  return handles;
}

OptimizerHandle Module::optimizer(size_t index) const {
  const size_t count = binding_ ? binding_->optimizers.size() : 0;
  if (index >= count)
    throw Error(ErrorKind::invalid_argument,
                binding_ ? fmt::format("optimizer({}): configure_optimizers() returned {} optimizer(s)", index, count)
                         : fmt::format("optimizer({}) needs a running Trainer (the Trainer calls "
                                       "configure_optimizers())",
                                       index));
  return {*this, *binding_->optimizers[index]};
}

void Module::clip_gradients(const OptimizerHandle& optimizer, double clip_value, GradClipAlgorithm algorithm) {
  if (!binding_ || !binding_->clip_gradients)
    throw Error(ErrorKind::invalid_argument, "clip_gradients() needs a running Trainer");
  if (!(clip_value >= 0) || !std::isfinite(clip_value))
    throw Error(ErrorKind::invalid_argument,
                fmt::format("clip_gradients(): clip_value = {} must be a finite number >= 0", clip_value));
  // Through the precision plugin: 16-mixed unscales first, so the threshold applies to true
  // gradients and the unscale inside step() becomes a no-op.
  binding_->clip_gradients(optimizer.optimizer(), clip_value, algorithm);
}

bool OptimizerHandle::step() {
  const Module::Binding* binding = module_->binding();
  if (!binding || !binding->optimizer_step)
    throw Error(ErrorKind::invalid_argument, "OptimizerHandle::step() needs a running Trainer (fit)");
  if (module_->automatic_optimization)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{}: optimizer step() was called with automatic optimization on, where the Trainer "
                            "steps after training_step; set automatic_optimization = false to step yourself",
                            module_->name()));
  return binding->optimizer_step(*optimizer_);
}

void OptimizerHandle::zero_grad(bool set_to_none) { optimizer_->zero_grad(set_to_none); }

}  // namespace fulgur
