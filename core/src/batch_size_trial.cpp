// The Trainer's side of the batch-size finder: the DataModule's training batch size, and a trial
// that trains a few batches at another size and leaves no trace (Lightning's BatchSizeFinder runs
// its trials through the fit loop after saving a checkpoint, and restores it after). Here a trial
// is a short loop of its own over a fresh train loader, so the fit's counters, loggers, callbacks
// and schedulers never see it; only the weights, the optimizer and loss-scaler states and the
// random state change during it, and those are copied to host memory before and put back after,
// also when a step throws.
#include <fulgur/error.h>
#include <fulgur/state_dict.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "loops/loop_scopes.h"
#include "trainer_engine.h"

namespace fulgur {

namespace {

// A copy of `value` whose tensors live in host memory: on a GPU the restore point must not take
// the device memory the trial is measuring (12 bytes per parameter with Adam).
c10::IValue host_copy(const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor tensor = value.toTensor().detach();
    return tensor.device().is_cpu() ? tensor.clone() : tensor.to(at::kCPU);
  }
  if (value.isGenericDict()) {
    const auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), host_copy(entry.value()));
    return out;
  }
  if (value.isList()) {
    const auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    for (const c10::IValue& element : list.vec()) out.push_back(host_copy(element));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& element : value.toTupleRef().elements()) elements.push_back(host_copy(element));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return value;
}

// The random state of a device's default generator (dropout draws from it during a trial).
at::Tensor generator_state(c10::Device device) {
  at::Generator generator =
      device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_generator_state(c10::Device device, const at::Tensor& state) {
  at::Generator generator =
      device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Everything a trial changes, copied before it and put back by restore(), or by the destructor
// when a step threw (then a failing restore is reported, not thrown: the step's error goes on).
class TrialRestorePoint {
 public:
  TrialRestorePoint(Strategy& strategy, Precision& precision, torch::nn::Module& model,
                    const std::vector<torch::optim::Optimizer*>& optimizers, DataModule& data, c10::Device device)
      : strategy_(strategy),
        precision_(precision),
        model_(model),
        optimizers_(optimizers),
        data_(data),
        device_(device),
        was_training_(model.is_training()),
        batch_size_(data.batch_size()),
        model_state_(host_copy(strategy.module_state_dict(model))),
        cpu_rng_state_(generator_state(c10::Device(c10::kCPU))) {
    for (torch::optim::Optimizer* optimizer : optimizers_)
      optimizer_states_.push_back(host_copy(strategy.optimizer_state_dict(*optimizer)));
    precision.state_dict(precision_state_);  // the loss scaler's scale and growth tracker
    precision_state_ = host_copy(precision_state_);
    if (!device.is_cpu()) device_rng_state_ = generator_state(device);
  }
  ~TrialRestorePoint() {
    if (restored_) return;
    try {
      restore();
    } catch (const std::exception& e) {
      spdlog::error("after a failed batch size trial, restoring the weights and optimizer states failed too: {}",
                    e.what());
    }
  }
  TrialRestorePoint(const TrialRestorePoint&) = delete;
  TrialRestorePoint& operator=(const TrialRestorePoint&) = delete;

  void restore() {
    restored_ = true;
    constexpr char kOrigin[] = "<batch size trial restore point>";
    for (torch::optim::Optimizer* optimizer : optimizers_) optimizer->zero_grad(/*set_to_none=*/true);
    strategy_.load_module_state_dict(model_, model_state_, /*strict=*/true, kOrigin);
    for (size_t i = 0; i < optimizers_.size(); ++i)
      strategy_.load_optimizer_state_dict(*optimizers_[i], optimizer_states_[i], kOrigin);
    if (!precision_state_.isNone()) precision_.load_state_dict(precision_state_);
    set_generator_state(c10::Device(c10::kCPU), cpu_rng_state_);
    if (device_rng_state_.defined()) set_generator_state(device_, device_rng_state_);
    model_.train(was_training_);
    data_.set_batch_size(batch_size_);
  }

 private:
  Strategy& strategy_;
  Precision& precision_;
  torch::nn::Module& model_;
  const std::vector<torch::optim::Optimizer*>& optimizers_;
  DataModule& data_;
  c10::Device device_;
  bool was_training_;
  int64_t batch_size_;
  c10::IValue model_state_;
  at::Tensor cpu_rng_state_;
  at::Tensor device_rng_state_;
  std::vector<c10::IValue> optimizer_states_;
  c10::IValue precision_state_;
  bool restored_ = false;
};

// Swaps a value for the scope's duration.
template <class T>
class Swap {
 public:
  Swap(T& slot, T value) : slot_(slot), saved_(std::move(slot)) { slot_ = std::move(value); }
  ~Swap() { slot_ = std::move(saved_); }
  Swap(const Swap&) = delete;
  Swap& operator=(const Swap&) = delete;

 private:
  T& slot_;
  T saved_;
};

}  // namespace

int64_t TrainerEngine::train_batch_size() const { return data_ ? data_->batch_size() : -1; }

void TrainerEngine::check_batch_size_change(std::string_view what) const {
  if (!data_ || stage_ != Stage::fit)
    throw Error(ErrorKind::config, fmt::format("{}: only during fit (from setup() or on_fit_start)", what));
  if (fit_loop_.running())
    throw Error(ErrorKind::config, fmt::format("{}: the fit has built its loaders already; change the batch size from "
                                               "setup() or on_fit_start",
                                               what));
  if (data_->batch_size() < 0)
    throw Error(ErrorKind::config, fmt::format("{}: the DataModule does not offer its batch size; override "
                                               "DataModule::batch_size() and set_batch_size(n) so that "
                                               "train_loader() uses n",
                                               what));
}

void TrainerEngine::set_train_batch_size(int64_t n) {
  check_batch_size_change("set_train_batch_size");
  if (n < 1) throw Error(ErrorKind::config, fmt::format("set_train_batch_size({}): the batch size must be >= 1", n));
  data_->set_batch_size(n);
}

BatchSizeTrial TrainerEngine::run_batch_size_trial(int64_t batch_size, int64_t steps) {
  check_batch_size_change("run_batch_size_trial");
  if (batch_size < 1 || steps < 1)
    throw Error(ErrorKind::config, fmt::format("run_batch_size_trial({}, {}): the batch size and the number of steps "
                                               "must be >= 1",
                                               batch_size, steps));
  Strategy& strategy = *plugins_.strategy;
  if (strategy.cluster().world_size > 1)
    throw Error(ErrorKind::config,
                fmt::format("run_batch_size_trial: not with {} processes (a rank that runs out of memory would "
                            "leave the others waiting in the gradient all-reduce); find the batch size in a run with "
                            "one process, then set it",
                            strategy.cluster().world_size));
  BatchSizeTrial result;
  TrialRestorePoint restore(strategy, *plugins_.precision, model(), optimizer_ptrs_, *data_, device());
  data_->set_batch_size(batch_size);
  std::unique_ptr<BatchLoader> loader = data_->train_loader();
  if (!loader) throw Error(ErrorKind::invalid_argument, "the DataModule returned no train_loader()");
  loader->set_replica(0, 1);
  result.batches_per_epoch = loader->num_batches();
  loader->start_epoch(0);
  // What the module logs in a trial goes to a store nobody reads; manual optimization's backward
  // and step go straight to the strategy, without the callbacks' hooks.
  MetricStore discarded;
  LogContext log(binding_, &discarded, /*training=*/true, /*allowed=*/true);
  Swap<std::function<void(const at::Tensor&)>> backward(binding_.manual_backward, [this](const at::Tensor& loss) {
    plugins_.strategy->backward(loss, *plugins_.precision, /*sync_gradients=*/true);
  });
  Swap<std::function<bool(torch::optim::Optimizer&)>> step(
      binding_.optimizer_step, [this](torch::optim::Optimizer& optimizer) {
        plugins_.precision->unscale_gradients(optimizer);
        return plugins_.strategy->optimizer_step(optimizer, *plugins_.precision);
      });
  module_->train();
  for (; result.batches_run < steps; ++result.batches_run) {
    std::optional<Batch> batch = loader->next();
    if (!batch) break;
    run_trial_batch(std::move(*batch), result.batches_run);
  }
  synchronize_device();  // a device's asynchronous out-of-memory error surfaces here, not later
  loader.reset();        // its worker threads and prefetched batches go before the restore
  restore.restore();
  return result;
}

void TrainerEngine::run_trial_batch(Batch batch, int64_t batch_idx) {
  Strategy& strategy = *plugins_.strategy;
  Precision& precision = *plugins_.precision;
  batch = transfer(std::move(batch));
  binding_.batch_size = batch.size();
  StepOutput output;
  {
    PrecisionScope scope(precision);
    output = module_->training_step(batch, batch_idx);
  }
  if (!module_->automatic_optimization || !output.loss.defined()) return;
  torch::optim::Optimizer& optimizer = *optimizer_ptrs_.front();
  optimizer.zero_grad(/*set_to_none=*/true);
  strategy.backward(output.loss, precision, /*sync_gradients=*/true);
  precision.unscale_gradients(optimizer);
  if (trainer_config_.gradient_clip_val > 0)
    strategy.clip_gradients(optimizer, precision, trainer_config_.gradient_clip_val,
                            trainer_config_.gradient_clip_algorithm);
  strategy.optimizer_step(optimizer, precision);
}

}  // namespace fulgur
