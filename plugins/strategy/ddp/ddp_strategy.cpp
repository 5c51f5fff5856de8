// Built-in strategy `ddp`: one process per device, each holding a full replica of the model.
// Initial parameters and buffers come from rank 0; gradients are averaged by c10d's Reducer in
// buckets that are all-reduced while backward is still running; each rank reads its own slice of
// the data. Everything distributed goes through the SDK's Communicator, so this file is what a
// third-party strategy (say ZeRO, with reduce_scatter and all_gather) would look like too.
#include <fulgur/communicator.h>
#include <fulgur/plugin.h>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string>

#include "../common/process_group_strategy.h"

namespace {

class DdpStrategy final : public fulgur::process_group::ProcessGroupStrategy {
 public:
  FULGUR_OPTIONS(Options,
                 (string, backend, "Process group backend: \"auto\" (the accelerator's), \"gloo\", \"nccl\"", "auto"),
                 (floating, timeout,
                  "Seconds a collective or the rendezvous may wait for the other ranks before failing", 1800.0),
                 (integer, bucket_cap_mb, "Size of the gradient buckets all-reduced during backward (MiB)", 25),
                 (boolean, find_unused_parameters,
                  "Allow parameters that get no gradient in a step (walks the graph each step)", false),
                 (boolean, gradient_as_bucket_view,
                  "Gradients alias the communication buckets (one copy and their memory less)", false),
                 (boolean, broadcast_buffers, "Send rank 0's buffers (BatchNorm statistics) before each step", true));
  // The base reads `backend` and `timeout` from the options as given.
  explicit DdpStrategy(const Options& options)
      : ProcessGroupStrategy("ddp", options.given()), broadcast_buffers_(options.broadcast_buffers) {
    sync_options_.bucket_cap_mb = options.bucket_cap_mb;
    sync_options_.find_unused_parameters = options.find_unused_parameters;
    sync_options_.gradient_as_bucket_view = options.gradient_as_bucket_view;
    if (sync_options_.bucket_cap_mb < 1)
      throw fulgur::Error(fulgur::ErrorKind::config, "strategy 'ddp': bucket_cap_mb must be at least 1");
  }

  void setup_module(torch::nn::Module& module) override {
    gradient_sync_.reset();  // a second stage (fit, then test) starts over
    module.to(device_);
    module_ = &module;
    if (!communicator_) return;
    // Every replica starts from rank 0's weights and buffers.
    std::vector<at::Tensor> state;
    for (auto& p : module.parameters()) state.push_back(p);
    for (auto& b : module.buffers()) state.push_back(b);
    communicator_->broadcast_coalesced(state, 0);
    buffers_ = module.buffers();
  }

  void before_training_step(bool sync_gradients) override {
    if (!communicator_) return;
    // Gradient buckets only for training, built on the parameters as they train: the precision
    // plugin converts the module after setup_module, and validate/test/predict never need them.
    if (!gradient_sync_ && module_) make_gradient_sync();
    if (gradient_sync_ && sync_gradients) gradient_sync_->prepare_for_forward();
    // BatchNorm statistics and the like follow rank 0, as PyTorch's DDP does before each forward.
    if (broadcast_buffers_ && !buffers_.empty()) communicator_->broadcast_coalesced(buffers_, 0);
  }

  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool sync_gradients) override {
    at::Tensor scaled = precision.scale_loss(loss);
    // Without prepare_for_backward the Reducer's hooks stay idle: gradients just accumulate.
    if (!gradient_sync_ || !sync_gradients) {
      explain_unused([&] { scaled.backward(); });
      return;
    }
    gradient_sync_->prepare_for_backward({scaled});
    try {
      explain_unused([&] { scaled.backward(); });
    } catch (...) {
      communicator_->rethrow("backward (gradient all-reduce)", std::current_exception());
    }
  }

  // With gradient accumulation, parameters that got no gradient leave the Reducer waiting for
  // them after a synchronised step; the next backward then reports a gradient "marked as ready
  // twice" in Python's terms. Say what happened and what to set.
  template <class F>
  void explain_unused(F&& backward) {
    try {
      backward();
    } catch (const c10::Error& e) {
      if (sync_options_.find_unused_parameters ||
          std::string(e.what_without_backtrace()).find("marked as ready twice") == std::string::npos)
        throw;
      throw fulgur::Error(fulgur::ErrorKind::config,
                          "strategy 'ddp': some parameters got no gradient in a synchronised step, so their "
                          "all-reduce never finished and the next backward (gradient accumulation) produced "
                          "gradients for it a second time; use every parameter in the loss, freeze them "
                          "(requires_grad = false), or set find_unused_parameters = true under [strategy]");
    }
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    return precision.optimizer_step(optimizer);
  }
  // Gradients are averaged in backward, so every rank reaches the same inf/NaN verdict on the
  // device; optimizer_step adds nothing to the precision's and may be bypassed.
  bool delegates_optimizer_step() const override { return true; }

  // Replicas are identical, so the Strategy defaults fit: rank zero writes one file and the others
  // wait at a barrier; the state dicts are the full ones.

  void teardown() override {
    gradient_sync_.reset();
    ProcessGroupStrategy::teardown();
  }

 private:
  void make_gradient_sync() {
    std::vector<at::Tensor> trainable;
    fulgur::GradientSyncOptions options = sync_options_;
    for (const auto& item : module_->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      trainable.push_back(item.value());
      options.parameter_names.push_back(item.key());
    }
    if (!trainable.empty()) gradient_sync_ = communicator_->make_gradient_sync(std::move(trainable), options);
  }

  bool broadcast_buffers_;
  fulgur::GradientSyncOptions sync_options_;
  std::unique_ptr<fulgur::GradientSync> gradient_sync_;
  torch::nn::Module* module_ = nullptr;
  std::vector<at::Tensor> buffers_;
};

}  // namespace

FULGUR_PLUGIN(DdpStrategy, "ddp", "0.1.0",
              "Data-parallel: one process per device, gradients averaged over c10d (Gloo on CPU, NCCL on CUDA) "
              "while backward runs")
