// Built-in strategy `model_parallel`: Lightning's ModelParallelStrategy(data_parallel_size,
// tensor_parallel_size). The ranks form a DeviceMesh (dp, tp), row-major as init_device_mesh; the
// model gets it before its configure_model (fulgur::DeviceMeshReceiver) and builds its layers on
// mesh.group("tp") (fulgur/nn/tensor_parallel.h). Each dp replica reads its own slice of the data
// (every tp rank of a replica the same), gradients are averaged over the dp group after backward,
// and norm clipping counts each tensor-parallel shard once. With zero_stage 1 or 2 the dp dimension
// is sharded as the fsdp strategy shards its ranks (2D: TP inside, ZeRO across; the fsdp plugin's
// Shards, sharded_parameter.h): each dp rank steps and keeps the optimizer state of its rows of
// every tp-local parameter, gradients are all-reduced (1) or reduce-scattered (2) over dp, and the
// updated rows are all-gathered after the step. With zero_stage 3 the parameters too are rows over
// dp, gathered around each fulgur::run_block block (fsdp's Zero3Units). With tensor_parallel_size > 1,
// checkpoints are torch.distributed.checkpoint directories in the chunk layout PyTorch writes for
// FSDP2 + TP (tp_checkpoint.h): every rank writes its shard, nothing is gathered, and any (dp, tp)
// layout, one process or Python reads them.
#include <fulgur/blocks.h>
#include <fulgur/communicator.h>
#include <fulgur/device_mesh.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/log.h>
#include <fulgur/model_parallel.h>
#include <fulgur/nn/tensor_parallel.h>
#include <fulgur/optim/lion.h>
#include <fulgur/optim/muon.h>
#include <fulgur/plugin.h>
#include <fulgur/precision.h>
#include <fulgur/state_dict.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../common/optimizer_state_map.h"
#include "../common/process_group_strategy.h"
#include "../fsdp/sharded_parameter.h"
#include "../fsdp/zero3_units.h"
#include "tp_checkpoint.h"

namespace {

class ModelParallelStrategy final : public fulgur::process_group::ProcessGroupStrategy, public fulgur::BlockHooks {
 public:
  FULGUR_OPTIONS(Options,
                 (string, backend, "Process group backend: \"auto\" (the accelerator's), \"gloo\", \"nccl\"", "auto"),
                 (floating, timeout,
                  "Seconds a collective or the rendezvous may wait for the other ranks before failing", 1800.0),
                 (integer, data_parallel_size, "Replicas of the model (0: the processes / tensor_parallel_size)", 0),
                 (integer, tensor_parallel_size, "Ranks each layer is split across (the mesh's tp dimension)", 1),
                 (integer, zero_stage,
                  "Sharding across the dp dimension, as the fsdp strategy's zero_stage: 0: none (every dp rank keeps "
                  "the whole optimizer state, gradients all-reduced); 1: optimizer state sharded over dp "
                  "(gradients all-reduced); 2: also gradients (reduce-scattered over dp); 3: also parameters "
                  "(gathered over dp around each fulgur::run_block block, freed after it)",
                  0));
  explicit ModelParallelStrategy(const Options& options)
      : ProcessGroupStrategy("model_parallel", options.given()),
        data_parallel_size_(options.data_parallel_size),
        tensor_parallel_size_(options.tensor_parallel_size) {
    if (tensor_parallel_size_ < 1 || data_parallel_size_ < 0)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          "strategy 'model_parallel': tensor_parallel_size must be at least 1 and "
                          "data_parallel_size at least 0 (0: the processes / tensor_parallel_size)");
    if (options.zero_stage < 0 || options.zero_stage > 3)
      throw fulgur::Error(fulgur::ErrorKind::config,
                          fmt::format("strategy 'model_parallel': zero_stage = {} is not one of 0 (no sharding over "
                                      "dp), 1 (optimizer state), 2 (and gradients) or 3 (and parameters)",
                                      options.zero_stage));
    sharding_.zero_stage = options.zero_stage;
  }
  ~ModelParallelStrategy() override { fulgur::remove_block_hooks(this); }

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
    auto dp_group = mesh_->group("dp");
    dp_ = fulgur::fsdp::RankGroup{dp_group && dp_group->world_size() > 1 ? dp_group.get() : nullptr, mesh_->size("dp"),
                                  mesh_->local_rank("dp"), device_};
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
    // Stage 3 of an earlier stage (fit, then validate): whole again before anything reads them.
    if (!shards_.ordered.empty() && sharding_.zero_stage == 3) units_.gather_group(shards_.ordered);
    units_.clear();
    shards_ = fulgur::fsdp::Shards{};
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
    if (sharding_.zero_stage != 3) return;
    // Stage 3: every parameter's rows over dp in a tensor of their own; the blocks the Module runs
    // through fulgur::run_block are the units whose parameters are gathered around their use (the
    // fsdp plugin's Zero3Units), the rest stays whole, in the Module's order on every rank.
    std::set<const fulgur::fsdp::ShardedParameter*> listed;
    for (const auto& item : module.named_parameters()) {
      fulgur::fsdp::ShardedParameter& sharded = shards_.of(item.value(), dp_, /*own_storage=*/true);
      if (listed.insert(&sharded).second) shards_.ordered.push_back(&sharded);
      shards_.named[item.key()] = &sharded;
    }
    fulgur::install_block_hooks(this);
  }

  void before_training_step(bool sync_gradients) override {
    if (sharding_.zero_stage == 3) units_.before_training_step(sync_gradients);
  }

  // ---- blocks (stage 3): fulgur::BlockHooks ----
  at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input,
                       const fulgur::BlockForward& forward) override {
    return units_.run_block(block, input, forward);
  }
  void gather_full_parameters(torch::nn::Module&) override { units_.hold_full_parameters(); }
  void release_full_parameters(torch::nn::Module&) override { units_.release_full_parameters(); }

  // Stage 3: the whole tp-local parameters (gathered over dp, a collective) and copied, since their
  // storage is freed again; the layout is made from them when they are written.
  c10::IValue module_state_dict(torch::nn::Module& module) override {
    if (sharding_.zero_stage != 3) return ProcessGroupStrategy::module_state_dict(module);
    fulgur::FullParameters whole(module);
    const c10::IValue state = ProcessGroupStrategy::module_state_dict(module);
    return state.isGenericDict() ? fulgur::fsdp::with_copied_tensors(state) : state;
  }

  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool sync_gradients) override {
    if (sharding_.zero_stage == 3) {
      // Each block's gradients are reduce-scattered over dp as soon as its backward is done.
      units_.begin_backward(sync_gradients);
      precision.scale_loss(loss).backward();
      units_.finish_backward();
      return;
    }
    precision.scale_loss(loss).backward();
    if (zero()) {
      // Each dp rank keeps its averaged rows of every gradient; micro-steps of an accumulation
      // window add up locally, without communication.
      if (sync_gradients && !shards_.ordered.empty()) shards_.reduce_gradients(sharding_, dp_);
      return;
    }
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
    if (zero() && algorithm == fulgur::GradClipAlgorithm::norm) {
      clip_sharded_gradients(optimizer, clip_value);
      return;
    }
    if (algorithm != fulgur::GradClipAlgorithm::norm || !module_ || tensor_parallel_size_ == 1) {
      precision.clip_gradients(optimizer, clip_value, algorithm);  // elementwise, or nothing split
      return;
    }
    if (clip_value > 0) fulgur::nn::clip_grad_norm_tensor_parallel(*module_, clip_value, mesh_->group("tp").get());
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    if (zero()) agree_on_non_finite_gradients(optimizer);
    const bool stepped = precision.optimizer_step(optimizer);
    if (stepped && sharding_.zero_stage == 3)
      units_.after_step();  // blocks gathered again at their next use, the rest now
    else if (stepped && zero())
      shards_.gather_parameters(dp_);  // every rank's updated rows, into the parameters
    if (stepped && !reported_state_) report_optimizer_state(optimizer);
    return stepped;
  }

  // Tensor-parallel ranks of one replica read the same batches.
  int64_t data_parallel_rank() const override { return mesh_ ? mesh_->local_rank("dp") : 0; }
  int64_t data_parallel_size() const override { return mesh_ ? mesh_->size("dp") : 1; }

  void setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) override {
    ProcessGroupStrategy::setup_optimizers(optimizers);
    optimizers_.clear();
    orders_.clear();
    if (sharding_.zero_stage != 3) shards_ = fulgur::fsdp::Shards{};
    shards_.optimizers.clear();
    shards_.by_optimizer.clear();
    reported_state_ = false;
    for (auto& optimizer : optimizers) {
      optimizers_.push_back(optimizer.get());
      if (!zero()) {
        orders_.push_back(fulgur::model_parallel::whole_order(*optimizer));
        continue;
      }
      // Element-wise optimizers only: their update of a row depends on that row alone, so stepping
      // rows equals stepping the whole (LBFGS, Muon and friends need the whole tensor).
      if (!dynamic_cast<torch::optim::Adam*>(optimizer.get()) && !dynamic_cast<torch::optim::AdamW*>(optimizer.get()) &&
          !dynamic_cast<torch::optim::SGD*>(optimizer.get()))
        throw fulgur::Error(fulgur::ErrorKind::config,
                            fmt::format("strategy 'model_parallel': zero_stage = {} steps each dp rank's rows of the "
                                        "parameters, which only an element-wise optimizer (Adam, AdamW, SGD) can do; "
                                        "use one of them, or zero_stage = 0",
                                        sharding_.zero_stage));
      // The optimizer steps this rank's rows of each (tp-local) parameter: a view of it, as under
      // fsdp's stages 1 and 2; the collectives' layout follows the param groups, the same on every rank.
      shards_.optimizers.push_back(optimizer.get());
      std::vector<fulgur::fsdp::ShardedParameter*>& order = shards_.by_optimizer[optimizer.get()];
      fulgur::model_parallel::StepOrder& steps = orders_.emplace_back();
      for (auto& group : optimizer->param_groups())
        for (at::Tensor& parameter : group.params()) {
          const bool new_one = !shards_.by_tensor.contains(parameter.unsafeGetTensorImpl());
          if (sharding_.zero_stage == 3 && new_one)
            throw fulgur::Error(fulgur::ErrorKind::config,
                                "strategy 'model_parallel': configure_optimizers passed a tensor that is not a "
                                "parameter of the Module; with zero_stage = 3 the optimizers may hold only the "
                                "Module's parameters");
          fulgur::fsdp::ShardedParameter& sharded =
              shards_.of(parameter, dp_, /*own_storage=*/sharding_.zero_stage == 3);
          if (new_one) shards_.ordered.push_back(&sharded);
          order.push_back(&sharded);
          steps.push_back({sharded.full, sharded.begin, sharded.local_rows()});
          parameter = sharded.stepped();
        }
    }
    if (zero() && sharding_.zero_stage != 3) shards_.lay_out_flat_buffers();
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
        // LibTorch's own archive of another optimizer (SophiaG, a third party's): one opaque blob
        // per rank, which rank 0 alone would write; each tp rank's shard state would be lost.
        // (Lion's and Muon's per-element tensors are in "state" instead: optimizer_state_dict.
        // LBFGS, whose history is over the whole flattened parameter vector, is refused before
        // training: it needs a closure, which this strategy's step does not run.)
        if (state.isGenericDict() && state.toGenericDict().contains("fulgur_archive") && !archived(*optimizers_[i]))
          throw fulgur::Error(fulgur::ErrorKind::checkpoint,
                              fmt::format("strategy 'model_parallel': cannot save '{}': optimizer {} keeps its state "
                                          "in one LibTorch archive, which the strategy cannot split by "
                                          "tensor-parallel shard (it splits fulgur::optim's Lion and Muon, whose "
                                          "state tensors are shaped like their parameters); use Adam, AdamW, SGD, "
                                          "Lion or Muon with tensor_parallel_size > 1",
                                          path, i));
        optimizer_states.push_back(fulgur::model_parallel::sharded_optimizer_state(
            (*parts.optimizer_states)[i], orders_[i], static_cast<int64_t>(i), pieces_, coordinate(), placements));
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
    fulgur::split_checkpoint(fulgur::model_parallel::read_local(path, pieces_, orders_), out, path);
    if (out.optimizer_states)
      for (c10::IValue& optimizer : *out.optimizer_states) optimizer = fulgur::dcp::with_index_keys(optimizer);
  }

  void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                              const std::string& origin) override {
    if (sharding_.zero_stage != 3) {
      ProcessGroupStrategy::load_module_state_dict(module, fulgur::model_parallel::local_module_state(state, pieces_),
                                                   strict, origin);
      return;
    }
    // Stage 3: into the whole parameters, whose rows go back to the shards.
    fulgur::FullParameters whole(module);
    ProcessGroupStrategy::load_module_state_dict(module, fulgur::model_parallel::local_module_state(state, pieces_),
                                                 strict, origin);
    torch::NoGradGuard no_grad;
    for (fulgur::fsdp::ShardedParameter* p : shards_.ordered)
      p->shard.copy_(p->rows_of(p->full_alias, p->begin, p->local_rows()).reshape(p->shard_shape()));
  }

  // Lion and Muon (fulgur::optim) keep their state in LibTorch's archive of the optimizer, whose
  // tensors here are this rank's tp shards. Under tensor parallelism their per-element tensors
  // (shaped like the parameter) leave the archive for torch.optim's "state" layout, where the
  // checkpoint chunks them like the parameter as it does AdamW's; the archive keeps the rest
  // (Muon's step counts, the groups' options).
  c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer) override {
    if (tensor_parallel_size_ == 1 || !archived(optimizer))
      return ProcessGroupStrategy::optimizer_state_dict(optimizer);
    std::vector<std::pair<at::Tensor*, at::Tensor>> held;  // taken out of the archive, put back after
    std::map<int64_t, std::vector<std::pair<std::string, at::Tensor>>> tensors;
    int64_t index = 0;
    for (auto& group : optimizer.param_groups())
      for (const at::Tensor& p : group.params()) {
        if (auto found = optimizer.state().find(p.unsafeGetTensorImpl()); found != optimizer.state().end())
          for (auto& [name, t] : archived_tensors(*found->second))
            if (t->defined()) {
              tensors[index].emplace_back(name, *t);
              held.emplace_back(t, *t);
              *t = at::Tensor();  // an undefined tensor is left out of the archive
            }
        ++index;
      }
    c10::IValue state;
    try {
      state = ProcessGroupStrategy::optimizer_state_dict(optimizer);
    } catch (...) {
      for (auto& [t, value] : held) *t = value;
      throw;
    }
    for (auto& [t, value] : held) *t = value;
    auto per_parameter = state.toGenericDict().at("state").toGenericDict();
    for (auto& [i, list] : tensors) {
      auto entry = per_parameter.contains(i) ? per_parameter.at(i).toGenericDict()
                                             : c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
      for (auto& [name, t] : list) entry.insert_or_assign(name, t);
      per_parameter.insert_or_assign(i, entry);
    }
    return state;
  }

  void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                 const std::string& origin) override {
    const auto position = std::find(optimizers_.begin(), optimizers_.end(), &optimizer);
    if (position == optimizers_.end())
      throw fulgur::Error(fulgur::ErrorKind::runtime,
                          "strategy 'model_parallel': an optimizer that setup_optimizers never saw");
    const fulgur::model_parallel::StepOrder& order = orders_[static_cast<size_t>(position - optimizers_.begin())];
    const c10::IValue local = fulgur::model_parallel::local_optimizer_state(state, order, pieces_);
    ProcessGroupStrategy::load_optimizer_state_dict(optimizer, local, origin);
    if (archived(optimizer)) load_archived_tensors(optimizer, local, order, origin);
  }

  void teardown() override {
    module_ = nullptr;
    fulgur::remove_block_hooks(this);
    optimizers_.clear();
    orders_.clear();
    // Stage 3 keeps its shards (the only copy of the weights) for a later stage's setup_module.
    if (sharding_.zero_stage != 3) shards_ = fulgur::fsdp::Shards{};
    pieces_ = {};
    ProcessGroupStrategy::teardown();
  }

 private:
  // Whether checkpoints are DCP directories, each rank writing its part: under tensor parallelism,
  // and under dp sharding (no rank holds all of the optimizer state).
  bool split() const { return (tensor_parallel_size_ > 1 || zero()) && module_ != nullptr; }
  bool zero() const { return sharding_.zero_stage > 0; }

  static bool archived(const torch::optim::Optimizer& optimizer) {
    return dynamic_cast<const fulgur::optim::Lion*>(&optimizer) || dynamic_cast<const fulgur::optim::Muon*>(&optimizer);
  }

  // Lion's and Muon's per-element state tensors, by their names in the archive (undefined ones
  // included: Muon keeps either a momentum buffer or AdamW's moments).
  static std::vector<std::pair<std::string, at::Tensor*>> archived_tensors(torch::optim::OptimizerParamState& state) {
    if (auto* lion = dynamic_cast<fulgur::optim::LionParamState*>(&state)) return {{"exp_avg", &lion->exp_avg()}};
    if (auto* muon = dynamic_cast<fulgur::optim::MuonParamState*>(&state))
      return {{"momentum_buffer", &muon->momentum_buffer()},
              {"exp_avg", &muon->exp_avg()},
              {"exp_avg_sq", &muon->exp_avg_sq()}};
    return {};
  }

  // After the archive is loaded: the tensors optimizer_state_dict moved to "state" (this rank's
  // shards, cut by local_optimizer_state) go back into the parameter states; an archive that kept
  // them (one process's, whole tensors) has them cut to this rank's shard.
  void load_archived_tensors(torch::optim::Optimizer& optimizer, const c10::IValue& local,
                             const fulgur::model_parallel::StepOrder& order, const std::string& origin) {
    const auto per_parameter = local.toGenericDict().at("state").toGenericDict();
    torch::NoGradGuard no_grad;
    for (size_t index = 0; index < order.size(); ++index) {
      const at::Tensor& parameter = order[index].parameter;
      auto found = optimizer.state().find(parameter.unsafeGetTensorImpl());
      if (found == optimizer.state().end()) continue;
      const auto saved = per_parameter.contains(static_cast<int64_t>(index))
                             ? per_parameter.at(static_cast<int64_t>(index)).toGenericDict()
                             : c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
      for (auto& [name, t] : archived_tensors(*found->second)) {
        if (saved.contains(name) && saved.at(name).isTensor())
          *t = saved.at(name).toTensor().clone();
        else if (t->defined())
          *t = fulgur::model_parallel::local_state_tensor(*t, pieces_, parameter);
        if (!t->defined()) continue;
        if (t->sizes() != parameter.sizes())
          throw fulgur::Error(
              fulgur::ErrorKind::checkpoint,
              fmt::format("{}: optimizer state '{}' of parameter {} has shape [{}], the parameter "
                          "(this rank's tensor-parallel shard) [{}]; the checkpoint belongs to another "
                          "model",
                          origin, name, index, fmt::join(t->sizes(), ", "), fmt::join(parameter.sizes(), ", ")));
        *t = t->to(parameter.device());
      }
    }
  }

  // By norm under dp sharding: the norm of the whole gradient, each element once: split
  // parameters' rows summed over dp and tp, replicated ones' over dp (tp rank 0's), in one
  // all-reduce over every rank; scaled as clip_grad_norm_tensor_parallel does.
  void clip_sharded_gradients(torch::optim::Optimizer& optimizer, double clip_value) {
    if (clip_value <= 0) return;
    const bool count_replicated = mesh_->local_rank("tp") == 0;
    at::Tensor sum_of_squares = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
    for (fulgur::fsdp::ShardedParameter* p : shards_.of_optimizer(optimizer)) {
      const at::Tensor& grad = p->stepped().grad();
      if (!grad.defined() || grad.numel() == 0) continue;
      const bool split = pieces_.by_tensor.contains(p->full.unsafeGetTensorImpl());
      if (split || count_replicated) sum_of_squares += grad.detach().to(at::kDouble).pow(2).sum().to(device_);
    }
    if (communicator_) communicator_->all_reduce(sum_of_squares, fulgur::ReduceOp::sum);
    const double coefficient = clip_value / (std::sqrt(sum_of_squares.item<double>()) + 1e-6);
    if (coefficient >= 1) return;
    torch::NoGradGuard no_grad;
    for (fulgur::fsdp::ShardedParameter* p : shards_.of_optimizer(optimizer))
      if (p->stepped().grad().defined()) p->stepped().mutable_grad().mul_(coefficient);
  }

  // A loss scaler skips a step with non-finite gradients; each rank sees only its rows of them, so
  // the ranks agree first (a NaN planted on the others makes them skip too), as fsdp does.
  void agree_on_non_finite_gradients(torch::optim::Optimizer& optimizer) {
    if (!communicator_) return;
    bool local = false;
    at::Tensor* mark = nullptr;
    for (fulgur::fsdp::ShardedParameter* p : shards_.of_optimizer(optimizer)) {
      at::Tensor& grad = p->stepped().mutable_grad();
      if (!grad.defined() || grad.numel() == 0) continue;
      if (!mark) mark = &grad;
      if (!grad.isfinite().all().item<bool>()) local = true;
    }
    if (!reduce_boolean_decision(local, /*all=*/false) || local || !mark) return;
    mark->view(-1)[0] = std::numeric_limits<double>::quiet_NaN();
  }

  // Once, after the first step: the bytes of optimizer state this rank keeps (what dp sharding
  // divides), at the default log level.
  void report_optimizer_state(torch::optim::Optimizer& optimizer) {
    reported_state_ = true;
    int64_t bytes = 0;
    const c10::IValue state = fulgur::optimizer_state_dict(optimizer);
    fulgur::optimizer_state::map_parameter_states(
        state, std::numeric_limits<int64_t>::max(),
        [&](int64_t, const std::string&, const at::Tensor& t) -> std::optional<at::Tensor> {
          if (t.dim() > 0) bytes += static_cast<int64_t>(t.nbytes());
          return std::nullopt;
        });
    fulgur::log::info(
        fmt::format("strategy 'model_parallel': rank {} (dp {} of {}, tp {} of {}) keeps {} bytes of optimizer state "
                    "(zero_stage {})",
                    cluster_.global_rank, mesh_->local_rank("dp"), mesh_->size("dp"), mesh_->local_rank("tp"),
                    mesh_->size("tp"), bytes, sharding_.zero_stage));
  }
  fulgur::model_parallel::Coordinate coordinate() const {
    return {mesh_->local_rank("dp"), mesh_->size("dp"), mesh_->local_rank("tp")};
  }

  int64_t data_parallel_size_, tensor_parallel_size_;
  std::optional<fulgur::DeviceMesh> mesh_;
  torch::nn::Module* module_ = nullptr;
  std::vector<torch::optim::Optimizer*> optimizers_;
  std::vector<fulgur::model_parallel::StepOrder> orders_;  // optimizers_' parameters, and the rows stepped
  fulgur::model_parallel::Pieces pieces_;
  // Sharding over dp (zero_stage 1, 2): the rows each optimizer steps, and where they travel.
  fulgur::fsdp::ShardingOptions sharding_;
  fulgur::fsdp::RankGroup dp_;
  fulgur::fsdp::Shards shards_;
  fulgur::fsdp::Zero3Units units_{shards_, sharding_, dp_};  // stage 3: the blocks gathered around their use
  bool reported_state_ = false;
};

}  // namespace

FULGUR_PLUGIN(ModelParallelStrategy, "model_parallel", "0.1.0",
              "Tensor parallelism inside data parallelism on a (dp, tp) device mesh: layers split with "
              "fulgur/nn/tensor_parallel.h, gradients averaged over dp or dp sharded ZeRO-style (zero_stage)")
