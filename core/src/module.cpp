#include <fulgur/error.h>
#include <fulgur/module.h>

#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include "binding.h"

namespace fulgur {

Module::Module() = default;
Module::~Module() = default;

StepOutput Module::validation_step(const Batch&, int64_t) { return {}; }
StepOutput Module::test_step(const Batch&, int64_t) { return {}; }
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

void Module::log(const std::string& name, const at::Tensor& value, const LogOptions& options) {
  if (!binding_ || !binding_->metrics) return;  // outside a Trainer run: nothing to log into
  if (!binding_->logging_allowed)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("log('{}') was called from a hook where logging is not allowed (as in Lightning: only "
                            "steps, batch/epoch hooks and backward/optimizer hooks may log)",
                            name));
  binding_->metrics->log(name, value, options, binding_->training_context, binding_->batch_size);
}

void Module::log(const std::string& name, double value, const LogOptions& options) {
  log(name, at::scalar_tensor(value, at::kDouble), options);
}

void Module::log_dict(const std::map<std::string, at::Tensor>& values, const LogOptions& options) {
  for (const auto& [k, v] : values) log(k, v, options);
}

void Module::manual_backward(const at::Tensor& loss) {
  if (!binding_ || !binding_->manual_backward)
    throw Error(ErrorKind::invalid_argument, "manual_backward() needs a running Trainer");
  binding_->manual_backward(loss);
}

std::vector<torch::optim::Optimizer*> Module::optimizers() const {
  return binding_ ? binding_->optimizers : std::vector<torch::optim::Optimizer*>{};
}

}  // namespace fulgur
