// Built-in strategy `model_parallel`: Lightning's ModelParallelStrategy(data_parallel_size,
// tensor_parallel_size). The ranks form a DeviceMesh (dp, tp), row-major as init_device_mesh; the
// model gets it before its configure_model (fulgur::DeviceMeshReceiver) and builds its layers on
// mesh.group("tp") (fulgur/nn/tensor_parallel.h). Each dp replica reads its own slice of the data
// (every tp rank of a replica the same), gradients are averaged over the dp group after backward,
// and norm clipping counts each tensor-parallel shard once. With tensor_parallel_size > 1,
// checkpoints are torch.distributed.checkpoint directories in the chunk layout PyTorch writes for
// FSDP2 + TP (tp_checkpoint.h): every rank writes its shard, nothing is gathered, and any (dp, tp)
// layout, one process or Python reads them.
#include <fulgur/communicator.h>
#include <fulgur/device_mesh.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/model_parallel.h>
#include <fulgur/nn/tensor_parallel.h>
#include <fulgur/plugin.h>
#include <fulgur/precision.h>
#include <fulgur/state_dict.h>

#include <ATen/ops/cat.h>
#include <fmt/format.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "../common/process_group_strategy.h"
#include "tp_checkpoint.h"

namespace {

class ModelParallelStrategy final : public fulgur::process_group::ProcessGroupStrategy {
 public:
  FULGUR_OPTIONS(Options,
                 (string, backend, "Process group backend: \"auto\" (the accelerator's), \"gloo\", \"nccl\"", "auto"),
                 (floating, timeout,
                  "Seconds a collective or the rendezvous may wait for the other ranks before failing", 1800.0),
                 (integer, data_parallel_size, "Replicas of the model (0: the processes / tensor_parallel_size)", 0),
                 (integer, tensor_parallel_size, "Ranks each layer is split across (the mesh's tp dimension)", 1));
  explicit ModelParallelStrategy(const Options& options)
      : ProcessGroupStrategy("model_parallel", options.given()),
        data_parallel_size_(options.data_parallel_size),
        tensor_parallel_size_(options.tensor_parallel_size) {
    if (tensor_parallel_size_ < 1 || data_parallel_size_ < 0)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          "strategy 'model_parallel': tensor_parallel_size must be at least 1 and "
                          "data_parallel_size at least 0 (0: the processes / tensor_parallel_size)");
  }

  void setup_environment(const fulgur::StrategyEnvironment& environment) override {
    ProcessGroupStrategy::setup_environment(environment);
    const int64_t world = cluster_.world_size;
    const int64_t dp = data_parallel_size_ == 0 ? world / tensor_parallel_size_ : data_parallel_size_;
    if (dp * tensor_parallel_size_ != world)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          fmt::format("strategy 'model_parallel': data_parallel_size {} x tensor_parallel_size {} = {} "
                                      "ranks, but the job has {} processes; make the product equal the number of "
                                      "devices (or leave data_parallel_size = 0)",
                                      dp, tensor_parallel_size_, dp * tensor_parallel_size_, world));
    if (communicator_)
      mesh_ = fulgur::DeviceMesh::create(*communicator_, {dp, tensor_parallel_size_}, {"dp", "tp"});
    else
      mesh_ = fulgur::DeviceMesh::from_groups(0, {1, 1}, {"dp", "tp"}, {nullptr, nullptr});
  }

  void configure_model(torch::nn::Module& module, const fulgur::ModelBuild& build) override {
    if (auto* receiver = fulgur::find_device_mesh_receiver(module))
      receiver->set_device_mesh(*mesh_);
    else if (tensor_parallel_size_ > 1)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          "strategy 'model_parallel': tensor_parallel_size > 1, but the model does not take the device "
                          "mesh; derive it from fulgur::DeviceMeshReceiver (fulgur/model_parallel.h) and build its "
                          "layers on mesh.group(\"tp\") in configure_model");
    if (build.configure) build.configure();
  }

  void setup_module(torch::nn::Module& module) override {
    module.to(device_);
    module_ = &module;
    pieces_ = fulgur::model_parallel::find_pieces(module, mesh_->local_rank("tp"));
    // The replicas of one shard start from dp rank 0's values (each tp rank holds its own shard).
    if (auto dp = mesh_->group("dp"); dp && dp->world_size() > 1) {
      std::vector<at::Tensor> state;
      for (auto& p : module.parameters()) state.push_back(p);
      for (auto& b : module.buffers()) state.push_back(b);
      dp->broadcast_coalesced(state, 0);
    }
  }

  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool sync_gradients) override {
    precision.scale_loss(loss).backward();
    auto dp = mesh_->group("dp");
    if (!sync_gradients || !dp || dp->world_size() == 1 || !module_) return;
    // One all-reduce of every gradient, flattened (the mean over the replicas' batches).
    std::vector<at::Tensor> grads;
    for (auto& p : module_->parameters())
      if (p.requires_grad() && p.grad().defined()) grads.push_back(p.mutable_grad());
    if (grads.empty()) return;
    std::vector<at::Tensor> flat;
    for (const auto& g : grads) flat.push_back(g.reshape({-1}));
    at::Tensor buffer = at::cat(flat);
    dp->all_reduce(buffer, fulgur::ReduceOp::mean);
    int64_t offset = 0;
    for (auto& g : grads) {
      g.copy_(buffer.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }

  void clip_gradients(torch::optim::Optimizer& optimizer, fulgur::Precision& precision, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    if (algorithm != fulgur::GradClipAlgorithm::norm || !module_ || tensor_parallel_size_ == 1) {
      precision.clip_gradients(optimizer, clip_value, algorithm);  // elementwise, or nothing split
      return;
    }
    if (clip_value > 0) fulgur::nn::clip_grad_norm_tensor_parallel(*module_, clip_value, mesh_->group("tp").get());
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    return precision.optimizer_step(optimizer);
  }

  // Tensor-parallel ranks of one replica read the same batches.
  int64_t data_parallel_rank() const override { return mesh_ ? mesh_->local_rank("dp") : 0; }
  int64_t data_parallel_size() const override { return mesh_ ? mesh_->size("dp") : 1; }

  void setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) override {
    ProcessGroupStrategy::setup_optimizers(optimizers);
    optimizers_.clear();
    for (auto& optimizer : optimizers) optimizers_.push_back(optimizer.get());
  }

  // ---- checkpoints (tensor_parallel_size > 1): each rank's shards in DCP's FSDP2 + TP layout ----
  // module_state_dict and optimizer_state_dict stay the default (this rank's tp shards, which the
  // loaders below take back as they are); the layout is made when they are written.

  // [trainer] async_checkpoint: without tensor parallelism the checkpoint is ProcessGroupStrategy's
  // one file, written in the background (fulgur/async_save.h); the tp layout below is one
  // collective dcp::save, which the host then runs synchronously (with its warning).
  void* extension(std::string_view id) noexcept override {
    if (split() && id == fulgur::AsyncSaveStrategy::kExtensionId) return nullptr;
    return ProcessGroupStrategy::extension(id);
  }

  void save_checkpoint(const fulgur::CheckpointParts& parts, const std::string& path) override {
    if (!split()) {
      ProcessGroupStrategy::save_checkpoint(parts, path);
      return;
    }
    std::map<std::string, fulgur::dcp::Chunk> placements;
    c10::IValue model_state = parts.model_state ? fulgur::model_parallel::sharded_module_state(
                                                      *parts.model_state, pieces_, coordinate(), placements)
                                                : c10::IValue();
    std::vector<c10::IValue> optimizer_states;
    if (parts.optimizer_states) {
      if (!parts.optimizer_states->empty() && parts.optimizer_states->size() != optimizers_.size())
        throw fulgur::Error(fulgur::ErrorKind::checkpoint,
                            fmt::format("strategy 'model_parallel': cannot save '{}': {} optimizer states for {} "
                                        "optimizers set up",
                                        path, parts.optimizer_states->size(), optimizers_.size()));
      for (size_t i = 0; i < parts.optimizer_states->size(); ++i) {
        const c10::IValue& state = (*parts.optimizer_states)[i];
        // LibTorch's own archive (Lion, Muon, LBFGS, ...): one opaque blob per rank, which rank 0
        // alone would write; each tp rank's shard state would be lost.
        if (state.isGenericDict() && state.toGenericDict().contains("fulgur_archive"))
          throw fulgur::Error(fulgur::ErrorKind::checkpoint,
                              fmt::format("strategy 'model_parallel': cannot save '{}': optimizer {} keeps its state "
                                          "in one LibTorch archive, which cannot be split by tensor-parallel shard; "
                                          "use Adam, AdamW or SGD with tensor_parallel_size > 1",
                                          path, i));
        optimizer_states.push_back(fulgur::model_parallel::sharded_optimizer_state(
            (*parts.optimizer_states)[i], *optimizers_[i], static_cast<int64_t>(i), pieces_, coordinate(), placements));
      }
    }
    fulgur::CheckpointParts layout = parts;
    if (parts.model_state) layout.model_state = &model_state;
    if (parts.optimizer_states) layout.optimizer_states = &optimizer_states;
    fulgur::dcp::save(path, fulgur::join_checkpoint(layout), placements, communicator_.get());
  }

  // A DCP directory: only this rank's region of each split tensor is read, whatever (dp, tp) wrote
  // it; a file (one process's whole tensors) is read whole and cut by the loaders below.
  void load_checkpoint(const std::string& path, const fulgur::CheckpointParts& out) override {
    if (!split() || !fulgur::dcp::is_distributed_checkpoint(path)) {
      ProcessGroupStrategy::load_checkpoint(path, out);
      return;
    }
    fulgur::split_checkpoint(fulgur::model_parallel::read_local(path, pieces_, optimizers_), out, path);
    if (out.optimizer_states)
      for (c10::IValue& optimizer : *out.optimizer_states) optimizer = fulgur::dcp::with_index_keys(optimizer);
  }

  void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                              const std::string& origin) override {
    ProcessGroupStrategy::load_module_state_dict(module, fulgur::model_parallel::local_module_state(state, pieces_),
                                                 strict, origin);
  }

  void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                 const std::string& origin) override {
    ProcessGroupStrategy::load_optimizer_state_dict(
        optimizer, fulgur::model_parallel::local_optimizer_state(state, optimizer, pieces_), origin);
  }

  void teardown() override {
    module_ = nullptr;
    optimizers_.clear();
    pieces_ = {};
    ProcessGroupStrategy::teardown();
  }

 private:
  bool split() const { return tensor_parallel_size_ > 1 && module_ != nullptr; }
  fulgur::model_parallel::Coordinate coordinate() const {
    return {mesh_->local_rank("dp"), mesh_->size("dp"), mesh_->local_rank("tp")};
  }

  int64_t data_parallel_size_, tensor_parallel_size_;
  std::optional<fulgur::DeviceMesh> mesh_;
  torch::nn::Module* module_ = nullptr;
  std::vector<torch::optim::Optimizer*> optimizers_;
  fulgur::model_parallel::Pieces pieces_;
};

}  // namespace

FULGUR_PLUGIN(ModelParallelStrategy, "model_parallel", "0.1.0",
              "Tensor parallelism inside data parallelism on a (dp, tp) device mesh: layers split with "
              "fulgur/nn/tensor_parallel.h, gradients averaged over dp")
