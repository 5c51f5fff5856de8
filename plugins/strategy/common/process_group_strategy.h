// What the data-parallel strategies (ddp, fsdp) share: one process per device, a c10d process
// group reached through the SDK's Communicator, and the collectives the Trainer and callbacks use.
// Header-only: each strategy is its own plugin library and may use only the SDK.
#pragma once

#include <fulgur/async_save.h>
#include <fulgur/checkpoint_io.h>
#include <fulgur/communicator.h>
#include <fulgur/plugin.h>
#include <fulgur/state_dict.h>
#include <fulgur/storage.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

namespace fulgur::process_group {

class ProcessGroupStrategy : public WithExtensions<Strategy, DeviceStepStrategy, AsyncSaveStrategy> {
 public:
  // `name` is the plugin's, for messages; `backend` and `timeout` are its options of those names.
  ProcessGroupStrategy(std::string name, const Options& options)
      : name_(std::move(name)),
        backend_(options.get_string("backend")),
        timeout_(std::chrono::milliseconds(static_cast<int64_t>(std::llround(options.get_float("timeout") * 1000.0)))) {
    if (backend_ != "auto" && backend_ != "gloo" && backend_ != "nccl")
      throw Error(ErrorKind::config, fmt::format("strategy '{}': backend = \"{}\" is not one of \"auto\", \"gloo\", "
                                                 "\"nccl\"",
                                                 name_, backend_));
    if (timeout_.count() <= 0)
      throw Error(ErrorKind::config, fmt::format("strategy '{}': timeout must be a positive number of seconds", name_));
  }

  bool launches_processes() const override { return true; }

  void setup_environment(const StrategyEnvironment& environment) override {
    cluster_ = environment.cluster;
    accelerator_ = environment.accelerator;
    if (environment.devices.empty())
      throw Error(ErrorKind::config, fmt::format("strategy '{}': no device was selected", name_));
    // One device per process: the local rank picks it (a one-device list serves every rank).
    const size_t index = environment.devices.size() == 1 ? 0 : static_cast<size_t>(cluster_.local_rank);
    if (index >= environment.devices.size())
      throw Error(ErrorKind::config, fmt::format("strategy '{}': local rank {} has no device ({} selected)", name_,
                                                 cluster_.local_rank, environment.devices.size()));
    device_ = environment.devices[index];
    if (accelerator_) accelerator_->setup_device(device_);
    if (cluster_.world_size == 1) return;  // a job of one: no process group needed
    const std::string backend =
        backend_ == "auto" ? (accelerator_ ? accelerator_->default_collective_backend() : "gloo") : backend_;
    if (backend == "nccl" && !device_.is_cuda())
      throw Error(ErrorKind::config, fmt::format("strategy '{}': backend \"nccl\" needs CUDA devices, this rank runs "
                                                 "on {}; use backend = \"gloo\"",
                                                 name_, device_.str()));
    if (!environment.connect)
      throw Error(ErrorKind::runtime, fmt::format("strategy '{}': the host offers no process group", name_));
    communicator_ = environment.connect(CommunicatorOptions{}.set_backend(backend).set_timeout(timeout_));
  }

  c10::Device root_device() const override { return device_; }
  const ClusterInfo& cluster() const override { return cluster_; }

  at::Tensor reduce(const at::Tensor& tensor, ReduceOp op) override {
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
    communicator_->all_reduce(votes, ReduceOp::sum);
    const int64_t yes = votes.item<int64_t>();
    return all ? yes == cluster_.world_size : yes > 0;
  }

  // Gradient collectives start from autograd hooks as buckets fill and the sharded step gathers
  // and scatters between host decisions: none of it is recorded in one graph yet.
  std::string step_capture_refusal() const override {
    return fmt::format(
        "strategy '{}' starts its gradient collectives from the host as buckets fill; captured "
        "steps (cuda_graphs) run with strategy = \"single_device\" for now",
        name_);
  }
  // A sharded step agrees the skip across ranks and refreshes shards after it: not delegated.
  bool delegates_optimizer_step() const override { return false; }

  int64_t data_parallel_rank() const override { return cluster_.global_rank; }
  int64_t data_parallel_size() const override { return cluster_.world_size; }

  void teardown() override {
    if (accelerator_) accelerator_->teardown();
  }

  // [trainer] async_checkpoint (fulgur/async_save.h) for Strategy::save_checkpoint's one file:
  // rank 0 writes the joined parts (replicas are identical) in the background, the others
  // nothing. The file is written atomically (fulgur/checkpoint_io.h), so there is no marker to
  // add once every rank is done, and nothing to remove when a write failed: the file at `path`
  // is either rank 0's complete one or the one it was to replace.
  std::function<void()> prepare_save(const CheckpointParts& parts, const std::string& path) override {
    if (cluster_.global_rank != 0) return {};
    // As save_checkpoint: a checkpoint may go to a directory that does not exist yet.
    const std::filesystem::path parent =
        is_storage_url(path) ? std::filesystem::path() : std::filesystem::path(path).parent_path();
    std::error_code error;
    if (!parent.empty()) std::filesystem::create_directories(parent, error);
    if (error)
      throw Error(ErrorKind::io, fmt::format("cannot write checkpoint '{}': creating directory '{}' failed: {}", path,
                                             parent.string(), error.message()));
    return [parts, path] { write_checkpoint_file(join_checkpoint(parts), path); };
  }
  void finish_save(const std::string&, bool) override {}

 protected:
  std::string name_;
  std::string backend_;
  std::chrono::milliseconds timeout_;
  c10::Device device_{c10::DeviceType::CPU};
  ClusterInfo cluster_;
  Accelerator* accelerator_ = nullptr;
  std::shared_ptr<Communicator> communicator_;
};

}  // namespace fulgur::process_group
