// Built-in strategy `single_device`: one process training on one device. Collectives are
// identities, the whole dataset is this process's shard, checkpoints are single files.
#include <fulgur/plugin.h>

#include <ATen/core/ivalue.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

namespace {

class SingleDeviceStrategy final : public fulgur::WithExtensions<fulgur::Strategy, fulgur::DeviceStepStrategy> {
 public:
  void setup_environment(const fulgur::StrategyEnvironment& environment) override {
    if (environment.devices.size() > 1)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          fmt::format("strategy 'single_device' runs on one device, but {} were selected; use "
                                      "devices = 1, or strategy = \"ddp\" for several",
                                      environment.devices.size()));
    device_ = environment.devices.empty() ? c10::Device(c10::DeviceType::CPU) : environment.devices.front();
    cluster_ = environment.cluster;
    accelerator_ = environment.accelerator;
    // As Lightning's strategies do: the device is made current before the model is touched.
    if (accelerator_) accelerator_->setup_device(device_);
  }

  c10::Device root_device() const override { return device_; }
  const fulgur::ClusterInfo& cluster() const override { return cluster_; }

  void setup_module(torch::nn::Module& module) override { module.to(device_); }
  // Module::to() moves parameters in place (same tensor objects) before configure_optimizers
  // runs, so the default setup_optimizers (keep them as they are) is right; checkpoints are the
  // default single file written by rank zero.

  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool /*sync_gradients*/) override {
    precision.scale_loss(loss).backward();
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    return precision.optimizer_step(optimizer);
  }
  // optimizer_step adds nothing to the precision's: a step decided on the device may bypass it.
  bool delegates_optimizer_step() const override { return true; }
  // backward() is the precision's scaled backward and nothing else; parameters are the model's.
  std::string step_capture_refusal() const override { return {}; }

  at::Tensor reduce(const at::Tensor& tensor, fulgur::ReduceOp) override { return tensor; }
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override { return {tensor}; }
  void broadcast(at::Tensor&, int64_t) override {}
  std::string broadcast_string(const std::string& value, int64_t) override { return value; }
  void barrier(std::string_view) override {}
  bool reduce_boolean_decision(bool decision, bool) override { return decision; }

  int64_t data_parallel_rank() const override { return 0; }
  int64_t data_parallel_size() const override { return 1; }

  void teardown() override {
    if (accelerator_) accelerator_->teardown();
  }

 private:
  c10::Device device_{c10::DeviceType::CPU};
  fulgur::ClusterInfo cluster_;
  fulgur::Accelerator* accelerator_ = nullptr;
};

}  // namespace

FULGUR_PLUGIN(SingleDeviceStrategy, "single_device", "0.1.0", "One process on one device (cpu or one GPU)")
