// ABI corpus, strategy `corpus_single`: built against the frozen SDK 1.0 headers. One process
// holding the whole model (replicated, not sharded): collectives are identities and checkpoints are
// the Strategy defaults (one file), as at 1.0. It offers the 1.0 extension DeviceStepStrategy, so
// the host asks it about captured steps through that extension's vtable.
#include <fulgur/plugin.h>

#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <string_view>
#include <vector>

namespace {

class CorpusSingle final : public fulgur::WithExtensions<fulgur::Strategy, fulgur::DeviceStepStrategy> {
 public:
  void setup_environment(const fulgur::StrategyEnvironment& environment) override {
    if (environment.devices.size() > 1)
      throw fulgur::Error(fulgur::ErrorKind::config, "strategy 'corpus_single' runs one process on one device");
    device_ = environment.devices.empty() ? c10::Device(c10::DeviceType::CPU) : environment.devices.front();
    cluster_ = environment.cluster;
    accelerator_ = environment.accelerator;
    if (accelerator_) accelerator_->setup_device(device_);
  }
  c10::Device root_device() const override { return device_; }
  const fulgur::ClusterInfo& cluster() const override { return cluster_; }

  void setup_module(torch::nn::Module& module) override { module.to(device_); }
  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool /*sync_gradients*/) override {
    precision.scale_loss(loss).backward();
  }
  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    return precision.optimizer_step(optimizer);
  }

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

  // DeviceStepStrategy (1.0): steps are not captured; optimizer_step is the precision's.
  std::string step_capture_refusal() const override { return "strategy 'corpus_single' does not capture steps"; }
  bool delegates_optimizer_step() const override { return true; }

 private:
  c10::Device device_{c10::DeviceType::CPU};
  fulgur::ClusterInfo cluster_;
  fulgur::Accelerator* accelerator_ = nullptr;
};

}  // namespace

FULGUR_PLUGIN(CorpusSingle, "corpus_single", "1.0.0", "ABI corpus: one process, the whole model on one device")
