// Built-in strategy `ddp`: one process per device, each holding a full replica of the model.
// Initial parameters and buffers come from rank 0; gradients are averaged by c10d's Reducer in
// buckets that are all-reduced while backward is still running; each rank reads its own slice of
// the data. Everything distributed goes through the SDK's Communicator, so this file is what a
// third-party strategy (say ZeRO, with reduce_scatter and all_gather) would look like too.
#include <fulgur/communicator.h>
#include <fulgur/plugin.h>

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cmath>

namespace {

class DdpStrategy final : public fulgur::Strategy {
 public:
  explicit DdpStrategy(const fulgur::Options& options)
      : backend_(options.get_string("backend")),
        timeout_(std::chrono::milliseconds(static_cast<int64_t>(std::llround(options.get_float("timeout") * 1000.0)))),
        broadcast_buffers_(options.get_bool("broadcast_buffers")) {
    sync_options_.bucket_cap_mb = options.get_int("bucket_cap_mb");
    sync_options_.find_unused_parameters = options.get_bool("find_unused_parameters");
    sync_options_.gradient_as_bucket_view = options.get_bool("gradient_as_bucket_view");
    if (backend_ != "auto" && backend_ != "gloo" && backend_ != "nccl")
      throw fulgur::Error(
          fulgur::ErrorKind::config,
          fmt::format("strategy 'ddp': backend = \"{}\" is not one of \"auto\", \"gloo\", \"nccl\"", backend_));
    if (timeout_.count() <= 0)
      throw fulgur::Error(fulgur::ErrorKind::config, "strategy 'ddp': timeout must be a positive number of seconds");
    if (sync_options_.bucket_cap_mb < 1)
      throw fulgur::Error(fulgur::ErrorKind::config, "strategy 'ddp': bucket_cap_mb must be at least 1");
  }

  bool launches_processes() const override { return true; }

  void setup_environment(const fulgur::StrategyEnvironment& environment) override {
    cluster_ = environment.cluster;
    accelerator_ = environment.accelerator;
    if (environment.devices.empty())
      throw fulgur::Error(fulgur::ErrorKind::config, "strategy 'ddp': no device was selected");
    // One device per process: the local rank picks it (a one-device list serves every rank).
    const size_t index = environment.devices.size() == 1 ? 0 : static_cast<size_t>(cluster_.local_rank);
    if (index >= environment.devices.size())
      throw fulgur::Error(fulgur::ErrorKind::config,
                          fmt::format("strategy 'ddp': local rank {} has no device ({} selected)", cluster_.local_rank,
                                      environment.devices.size()));
    device_ = environment.devices[index];
    if (accelerator_) accelerator_->setup_device(device_);
    if (cluster_.world_size == 1) return;  // a job of one: no process group needed
    const std::string backend =
        backend_ == "auto" ? (accelerator_ ? accelerator_->default_collective_backend() : "gloo") : backend_;
    if (backend == "nccl" && !device_.is_cuda())
      throw fulgur::Error(fulgur::ErrorKind::config,
                          fmt::format("strategy 'ddp': backend \"nccl\" needs CUDA devices, this rank runs on {}; use "
                                      "backend = \"gloo\"",
                                      device_.str()));
    if (!environment.connect)
      throw fulgur::Error(fulgur::ErrorKind::runtime, "strategy 'ddp': the host offers no process group");
    communicator_ = environment.connect(fulgur::CommunicatorOptions{}.set_backend(backend).set_timeout(timeout_));
  }

  c10::Device root_device() const override { return device_; }
  const fulgur::ClusterInfo& cluster() const override { return cluster_; }

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
      scaled.backward();
      return;
    }
    gradient_sync_->prepare_for_backward({scaled});
    try {
      scaled.backward();
    } catch (...) {
      communicator_->rethrow("backward (gradient all-reduce)", std::current_exception());
    }
  }

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

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    return precision.optimizer_step(optimizer);
  }

  at::Tensor reduce(const at::Tensor& tensor, fulgur::ReduceOp op) override {
    if (!communicator_) return tensor;
    at::Tensor result = tensor.detach().clone();
    communicator_->all_reduce(result, op);
    return result;
  }

  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
    if (!communicator_) return {tensor};
    return communicator_->all_gather(tensor.detach().contiguous());
  }

  void broadcast(at::Tensor& tensor, int64_t src) override {
    if (communicator_) communicator_->broadcast(tensor, src);
  }

  std::string broadcast_string(const std::string& value, int64_t src) override {
    if (!communicator_) return value;
    at::Tensor size = at::scalar_tensor(static_cast<int64_t>(value.size()), at::kLong).reshape({1});
    communicator_->broadcast(size, src);
    const int64_t n = size.item<int64_t>();
    at::Tensor bytes = cluster_.global_rank == src
                           ? at::from_blob(const_cast<char*>(value.data()), {n}, at::kByte).clone()
                           : at::empty({n}, at::kByte);
    if (n > 0) communicator_->broadcast(bytes, src);
    return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(n));
  }

  void barrier(std::string_view) override {
    if (communicator_) communicator_->barrier();
  }

  bool reduce_boolean_decision(bool decision, bool all) override {
    if (!communicator_) return decision;
    at::Tensor votes = at::scalar_tensor(decision ? 1 : 0, at::kLong).reshape({1});
    communicator_->all_reduce(votes, fulgur::ReduceOp::sum);
    const int64_t yes = votes.item<int64_t>();
    return all ? yes == cluster_.world_size : yes > 0;
  }

  int64_t data_parallel_rank() const override { return cluster_.global_rank; }
  int64_t data_parallel_size() const override { return cluster_.world_size; }

  // Replicas are identical, so the Strategy defaults fit: rank zero writes one file and the others
  // wait at a barrier; the state dicts are the full ones.

  void teardown() override {
    gradient_sync_.reset();
    if (accelerator_) accelerator_->teardown();
  }

 private:
  std::string backend_;
  std::chrono::milliseconds timeout_;
  bool broadcast_buffers_;
  fulgur::GradientSyncOptions sync_options_;
  c10::Device device_{c10::DeviceType::CPU};
  fulgur::ClusterInfo cluster_;
  fulgur::Accelerator* accelerator_ = nullptr;
  std::shared_ptr<fulgur::Communicator> communicator_;
  std::unique_ptr<fulgur::GradientSync> gradient_sync_;
  torch::nn::Module* module_ = nullptr;
  std::vector<at::Tensor> buffers_;
};

}  // namespace

FULGUR_PLUGIN(
    DdpStrategy, "ddp", "0.1.0",
    "Data-parallel: one process per device, gradients averaged over c10d (Gloo on CPU, NCCL on CUDA) "
    "while backward runs",
    FULGUR_OPTION(string, backend, "Process group backend: \"auto\" (the accelerator's), \"gloo\", \"nccl\"", "auto"),
    FULGUR_OPTION(floating, timeout,
                  "Seconds a collective or the rendezvous may wait for the other ranks before failing", 1800.0),
    FULGUR_OPTION(integer, bucket_cap_mb, "Size of the gradient buckets all-reduced during backward (MiB)", 25),
    FULGUR_OPTION(boolean, find_unused_parameters,
                  "Allow parameters that get no gradient in a step (walks the graph each step)", false),
    FULGUR_OPTION(boolean, gradient_as_bucket_view,
                  "Gradients alias the communication buckets (one copy and their memory less)", false),
    FULGUR_OPTION(boolean, broadcast_buffers, "Send rank 0's buffers (BatchNorm statistics) before each step", true))
