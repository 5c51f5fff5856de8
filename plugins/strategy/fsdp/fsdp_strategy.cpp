// Built-in strategy `fsdp`: sharded data parallel, ZeRO stages 1, 2 and 3, one process per device.
//
// Every parameter the optimizers step is split on dim 0 into world_size chunks of rows
// (sharded_parameter.h). Each rank's optimizer steps only its own rows ("shards": views of those
// rows that replace the parameters in the optimizer's param groups, so LR schedulers and
// param-group indices stay as configure_optimizers made them); its optimizer state (Adam's two
// moments, SGD's momentum) therefore exists for 1/world_size of the model.
//
//   zero_stage = 1  gradients are all-reduced, each rank keeps its rows of them   8Ψ + 8Ψ/N bytes*
//   zero_stage = 2  gradients are reduce-scattered: each rank receives only its rows 4Ψ + 12Ψ/N
//   zero_stage = 3  parameters are sharded too: whole only around the blocks that use them  16Ψ/N
//   (the blocks: the Module's fulgur::run_block calls, and the submodules auto_wrap_policy routes
//   there, auto_wrap.h; a model none of whose parameters is in a unit is refused)
//   (* fp32 parameters and Adam, Ψ parameters, N ranks; DeepSpeed's accounting)
//
// Stages 1 and 2: after the step, one all-gather of the updated rows refreshes the full
// parameters, which every rank keeps for forward and backward. With overlap_reduce (the default)
// their gradients are averaged in buckets started from gradient hooks while backward runs
// (gradient_buckets.h); stage 3 then starts each block's reduce-scatter asynchronously.
//
// Stage 3: the shards are tensors of their own and the parameters' storage is freed (their shape
// stays, so autograd and the Module see the same parameters). The blocks a Module runs through
// fulgur::run_block are gathered around their forward and backward and their gradients
// reduce-scattered as soon as their backward is done (zero3_units.h). Parameters outside blocks
// stay whole, as in stage 2 (FSDP's root unit); the first backward logs (info) how much of the
// model is sharded. fulgur::FullParameters makes every parameter whole and, when released, writes
// this rank's rows of them back to the shards (FSDP's summon_full_params with writeback): what a
// callback changes in the weights (ema, swa, model_pruning) is what the next gather sees.
//
// Clipping by norm uses the global norm across shards, and a skipped step (inf/NaN gradients under
// a loss scaler) is skipped on every rank together. Checkpoints hold the full, unsharded model and
// optimizer state in torch.optim's layout, gathered on rank zero (state_dict_type = "full"), or
// each rank's rows in a torch.distributed.checkpoint directory ("sharded"), which stage 3 reads
// back row by row; both load under any world size and any strategy (fsdp_state.h).
//
// Optimizers: those whose update of a row depends on that row alone (Adam, AdamW, SGD and
// fulgur::optim's Lion) step shards as they step whole parameters. fulgur::optim::Muon's
// Newton-Schulz needs whole matrices: they are gathered per matrix (MuonRowShard): each rank's
// Nesterov update rows, in bfloat16, all-gathered into the whole matrix, orthogonalized on every
// rank, each rank applying its rows. Per step and Muon matrix of R x C on N ranks each rank sends
// 2 * ceil(R / N) * C bytes and receives (N - 1) times that; the momentum stays sharded in the same
// rows as Adam's moments, so checkpoints and resharding are unchanged. (Assigning whole matrices
// to ranks round-robin would split the Newton-Schulz compute N ways but move the momentum off the
// row layout and need a second collective to hand the rows back.)
//
// offload_optimizer (ZeRO-Offload): the optimizer steps a host-memory copy of this rank's rows
// (pinned when the device is cuda), so its state (Adam's 8 bytes per parameter) never occupies the
// device. Reduced gradients land in host memory in one copy per collective; after the step the
// updated rows go back to the device shards, which the all-gathers and checkpoints read as before.
#include <fulgur/blocks.h>
#include <fulgur/communicator.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/log.h>
#include <fulgur/optim/lion.h>
#include <fulgur/optim/muon.h>
#include <fulgur/plugin.h>
#include <fulgur/state_dict.h>
#include <fulgur/storage.h>
#include <fulgur/strategy.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
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
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../common/process_group_strategy.h"
#include "auto_wrap.h"
#include "dcp_async.h"
#include "dcp_storage.h"
#include "fsdp_state.h"
#include "gradient_buckets.h"
#include "sharded_parameter.h"
#include "zero3_units.h"

namespace {

using fulgur::Error;
using fulgur::ErrorKind;
using fulgur::fsdp::ShardedParameter;

class FsdpStrategy final : public fulgur::process_group::ProcessGroupStrategy, public fulgur::BlockHooks {
 public:
  FULGUR_OPTIONS(
      Options,
      (integer, zero_stage,
       "1: shard optimizer state (gradients all-reduced); 2: also shard gradients (reduce-scattered); 3: "
       "also shard parameters (whole only inside the blocks that use them)",
       2),
      (boolean, reshard_after_forward,
       "zero_stage = 3: free a block's gathered parameters after its forward and gather them again for its "
       "backward (false: keep them until the block's backward is done: one all-gather fewer per block, "
       "more memory)",
       true),
      (boolean, prefetch,
       "zero_stage = 3: start the all-gather of the next block (in the order of the previous training "
       "forward; backward: the previous block) before the current one computes, so that they overlap",
       true),
      (boolean, overlap_reduce,
       "average the gradients while backward still runs: zero_stage = 1 and 2 in buckets of reduce_bucket_mb "
       "(the last layers' first), each all-reduced (1) or reduce-scattered (2) as soon as backward has produced "
       "its gradients; zero_stage = 3 each block's reduce-scatter as soon as its backward is done (at most two "
       "under way); false: one collective after backward (stages 1, 2) or each block's reduce-scatter waited "
       "for at once (3); the results are the same",
       true),
      (floating, reduce_bucket_mb,
       "zero_stage = 1 and 2 with overlap_reduce: the gradients one bucket averages, in MiB of the reduce dtype "
       "(a larger parameter is a bucket of its own); smaller buckets start earlier in backward, larger ones "
       "cost fewer collectives",
       25.0),
      (string, reduce_dtype,
       "dtype the gradients are averaged in across ranks: \"auto\" (param_dtype's, else the parameters'), "
       "\"float32\", "
       "\"bfloat16\" (half the bytes on the wire), \"float16\", \"float64\"; the shards' gradients are in "
       "the parameters' dtype",
       "auto"),
      (string, param_dtype,
       "zero_stage = 3: dtype the blocks' parameters are gathered and computed in (FSDP2's param_dtype): "
       "\"auto\" (the model's), \"bfloat16\" (half the bytes gathered and held), \"float16\", "
       "\"float32\", \"float64\"; a block's inputs are cast to it and its output back; the shards, "
       "optimizer state, checkpoints and fulgur::FullParameters stay in the model's dtype; gradients are "
       "then averaged in it unless reduce_dtype says otherwise",
       "auto"),
      (string, state_dict_type,
       "\"full\": checkpoints are one file of whole tensors, gathered on rank 0; \"sharded\": a directory in "
       "torch.distributed.checkpoint's format, each rank writing its own rows (no gathering); both resume "
       "under any world size and strategy",
       "full"),
      (boolean, offload_optimizer,
       "ZeRO-Offload: the optimizer steps a copy of this rank's rows in host memory (pinned), so its state "
       "(Adam: 8 bytes per parameter) stays off the device; gradients travel to host memory after each "
       "reduction and the updated rows back after each step; for accelerator = \"cuda\" (on cpu it only "
       "adds copies, with a warning)",
       false),
      (string, auto_wrap_policy,
       "zero_stage = 3: which submodules are units besides the Module's fulgur::run_block blocks (FSDP's "
       "auto_wrap_policy): \"blocks\" (none: a model whose blocks hold no parameter is refused, since nothing "
       "would be sharded), \"root\" (none, and parameters outside blocks may stay whole, as FSDP's root unit: "
       "ZeRO-2's memory for them), \"size\" (every submodule with at least auto_wrap_min_params parameters not "
       "in a smaller unit: size_based_auto_wrap_policy), \"modules\" (every submodule whose class is in "
       "auto_wrap_modules: ModuleWrapPolicy); a selected submodule must be an element of a torch::nn::Sequential "
       "(LibTorch modules have no forward hooks; the Sequential calls it through run_block)",
       "blocks"),
      (integer, auto_wrap_min_params,
       "auto_wrap_policy = \"size\": the parameters a submodule must hold to be a unit (FSDP's min_num_params)",
       100000000),
      (string_list, auto_wrap_modules,
       "auto_wrap_policy = \"modules\": module classes that become units, as Module::name() calls them "
       "(\"torch::nn::Linear\", \"Linear\", \"MyBlockImpl\" or \"MyBlock\")",
       []),
      (string, backend, "Process group backend: \"auto\" (the accelerator's), \"gloo\", \"nccl\"", "auto"),
      (floating, timeout, "Seconds a collective or the rendezvous may wait for the other ranks before failing",
       1800.0));
  // The base reads `backend` and `timeout` from the options as given.
  explicit FsdpStrategy(const Options& options)
      : ProcessGroupStrategy("fsdp", options.given()),
        sharded_checkpoints_(parse_state_dict_type(options)),
        sharding_(parse_sharding(options)),
        auto_wrap_(parse_auto_wrap(options, sharding_)) {}
  ~FsdpStrategy() override {
    disconnect_muon();
    fulgur::remove_block_hooks(this);
  }

  void setup_environment(const fulgur::StrategyEnvironment& environment) override {
    ProcessGroupStrategy::setup_environment(environment);
    group_ = {communicator_.get(), cluster_.world_size, cluster_.global_rank, device_};
  }

  // Stage 3: blocks the Module marks with fulgur::built_block while it builds are sharded at once
  // (block_built below), so a rank holds its shards and one whole block, never the whole model.
  void configure_model(torch::nn::Module& module, const fulgur::ModelBuild& build) override {
    if (sharding_.zero_stage != 3) {
      ProcessGroupStrategy::configure_model(module, build);
      return;
    }
    // A later stage (fit, then validate or test): the shards from before stay, and are the
    // weights; the blocks are claimed again by their next run_block. Never whole in between.
    keep_shards_for_next_stage();
    // Every rank builds from rank zero's random state: the blocks sharded as they are built are
    // then rows of the same weights (what setup_module's broadcast gives the rest of the model),
    // and the weights one process seeded like rank zero builds. A rank seeded differently gets its
    // own state back afterwards, as it would keep it under ddp.
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    at::Tensor own;
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      own = generator.get_state();
    }
    const std::string own_bytes(static_cast<const char*>(own.const_data_ptr()), own.nbytes());
    const std::string zero_bytes = communicator_ ? broadcast_string(own_bytes, 0) : own_bytes;
    const bool seeded_like_zero = zero_bytes == own_bytes;
    auto set_state = [&](const at::Tensor& state) {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    };
    if (!seeded_like_zero) {
      at::Tensor zero = at::empty_like(own);
      std::memcpy(zero.mutable_data_ptr(), zero_bytes.data(), zero_bytes.size());
      set_state(zero);
    }
    fulgur::install_block_hooks(this);
    building_ = &build;
    built_blocks_ = 0;
    largest_built_bytes_ = built_bytes_ = 0;
    try {
      ProcessGroupStrategy::configure_model(module, build);
    } catch (...) {
      building_ = nullptr;
      throw;
    }
    building_ = nullptr;
    if (!seeded_like_zero) set_state(own);
    if (built_blocks_ > 0 && fulgur::log::enabled(fulgur::log::Level::debug)) {
      int64_t kept = 0;
      for (const auto& [impl, p] : shards_.by_tensor) kept += static_cast<int64_t>(p.shard.nbytes());
      fulgur::log::debug(fmt::format(
          "strategy 'fsdp': rank {} sharded {} blocks as they were built: {} bytes of parameters, this rank keeps "
          "{} bytes of them; the largest block was whole for a moment: {} bytes",
          cluster_.global_rank, built_blocks_, built_bytes_, kept, largest_built_bytes_));
    }
  }

  void block_built(torch::nn::Module& block) override {
    if (building_ == nullptr) return;  // only while configure_model runs
    if (building_->prepare) building_->prepare(block);
    int64_t bytes = 0;
    for (const at::Tensor& parameter : block.parameters()) {
      if (shards_.by_tensor.contains(parameter.unsafeGetTensorImpl())) continue;  // a nested block's, sharded already
      ShardedParameter& p = shard_of(parameter);
      bytes += static_cast<int64_t>(p.full_nbytes);
      fulgur::fsdp::release(p);
    }
    ++built_blocks_;
    built_bytes_ += bytes;
    largest_built_bytes_ = std::max(largest_built_bytes_, bytes);
  }

  void setup_module(torch::nn::Module& module) override {
    // Stage 3 keeps what configure_model sharded; a model set up before without configure_model
    // in between is made whole first.
    if (sharding_.zero_stage == 3 && !shards_.ordered.empty()) forget_shards();
    if (sharding_.zero_stage != 3) shards_.by_tensor.clear();
    buckets_.clear();
    forget_mappings();
    module.to(device_);
    if (communicator_) {
      // Every rank starts from rank 0's weights and buffers, as under ddp (the blocks sharded as
      // they were built are rank 0's already, and hold no storage to send).
      std::vector<at::Tensor> state;
      for (auto& p : module.parameters())
        if (!shards_.by_tensor.contains(p.unsafeGetTensorImpl())) state.push_back(p);
      for (auto& b : module.buffers()) state.push_back(b);
      communicator_->broadcast_coalesced(state, 0);
    }
    if (sharding_.zero_stage == 3) {
      // Every parameter is sharded, in the optimizers or not (frozen ones take memory too), in
      // the Module's order: the same on every rank. Blocks sharded as they were built are in
      // the shards already; a parameter reached twice (tied) is listed once.
      std::set<const ShardedParameter*> listed;
      for (const auto& item : module.named_parameters()) {
        ShardedParameter& sharded = shard_of(item.value());
        if (listed.insert(&sharded).second) shards_.ordered.push_back(&sharded);
        shards_.named[item.key()] = &sharded;
      }
      // Shards kept from a previous stage of another model (a new Module for this stage) go.
      std::erase_if(shards_.by_tensor, [&](const auto& entry) { return !listed.contains(&entry.second); });
      fulgur::install_block_hooks(this);
      auto_wrapped_ = fulgur::fsdp::auto_wrap(module, auto_wrap_).units;
      units_checked_ = false;
    }
  }

  void teardown() override {
    buckets_.clear();
    disconnect_muon();
    fulgur::remove_block_hooks(this);
    ProcessGroupStrategy::teardown();
  }

  // The optimizers step this rank's rows: each parameter in their groups is swapped for its shard.
  void setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) override {
    buckets_.clear();
    if (sharding_.zero_stage != 3) {
      shards_.by_tensor.clear();
      shards_.ordered.clear();
    }
    shards_.by_optimizer.clear();
    shards_.optimizers.clear();
    for (auto& optimizer : optimizers) {
      check_supported(*optimizer);
      if (sharded_checkpoints_ && archived(*optimizer))
        throw Error(ErrorKind::config,
                    "strategy 'fsdp': state_dict_type = \"sharded\" writes the state of Adam, AdamW and SGD row by "
                    "row; fulgur::optim's Lion and Muon keep theirs in one archive, gathered whole: use "
                    "state_dict_type = \"full\"");
      shards_.optimizers.push_back(optimizer.get());
      std::vector<ShardedParameter*>& order = shards_.by_optimizer[optimizer.get()];
      for (auto& group : optimizer->param_groups())
        for (at::Tensor& parameter : group.params()) {
          const bool new_one = !shards_.by_tensor.contains(parameter.unsafeGetTensorImpl());
          if (sharding_.zero_stage == 3 && new_one)
            throw Error(ErrorKind::config,
                        "strategy 'fsdp': configure_optimizers passed a tensor that is not a parameter of the "
                        "Module; with zero_stage = 3 the optimizers may hold only the Module's parameters");
          ShardedParameter& sharded = shard_of(parameter);
          // The collectives' layout follows the optimizers' param groups: the same order on every rank.
          if (new_one) shards_.ordered.push_back(&sharded);
          order.push_back(&sharded);
          if (sharding_.offload_optimizer) sharded.host = host_copy(sharded.shard);
          parameter = sharded.stepped();
        }
    }
    if (sharding_.offload_optimizer) report_offload();
    shards_.lay_out_flat_buffers();
    if (sharding_.zero_stage != 3 && sharding_.overlap_reduce) buckets_.set_up(shards_, sharding_.reduce_bucket_bytes);
    connect_muon(optimizers);
    units_.reset_traffic();
  }

  void before_training_step(bool sync_gradients) override { units_.before_training_step(sync_gradients); }

  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool sync_gradients) override {
    if (sharding_.zero_stage == 3) {
      if (!units_checked_) check_units();
      units_.begin_backward(sync_gradients);
      precision.scale_loss(loss).backward();
      units_.finish_backward();
      return;
    }
    // Micro-steps of an accumulation window add up locally, without communication.
    if (!sync_gradients || shards_.by_tensor.empty()) {
      precision.scale_loss(loss).backward();
      return;
    }
    if (buckets_.empty()) {
      precision.scale_loss(loss).backward();
      shards_.reduce_gradients(sharding_, group_);
      return;
    }
    buckets_.begin_backward();
    try {
      precision.scale_loss(loss).backward();
    } catch (...) {
      buckets_.abandon();
      throw;
    }
    buckets_.finish_backward();
    if (fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(fmt::format("strategy 'fsdp': {} of {} gradient buckets started during backward",
                                     buckets_.started_during_backward(), buckets_.bucket_count()));
  }

  // By norm: the norm of the whole gradient, across every rank's rows (torch's clip_grad_norm_).
  void clip_gradients(torch::optim::Optimizer& optimizer, fulgur::Precision& precision, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    if (algorithm == fulgur::GradClipAlgorithm::value) {
      precision.clip_gradients(optimizer, clip_value, algorithm);  // element-wise: the same on shards
      return;
    }
    at::Tensor sum_of_squares = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
    for (ShardedParameter* p : shards_.of_optimizer(optimizer))
      if (const at::Tensor& grad = p->stepped().grad(); grad.defined() && grad.numel() > 0)
        sum_of_squares += grad.detach().to(at::kDouble).pow(2).sum().to(device_);
    if (communicator_) communicator_->all_reduce(sum_of_squares, fulgur::ReduceOp::sum);
    const double total_norm = std::sqrt(sum_of_squares.item<double>());
    const double coefficient = std::min(1.0, clip_value / (total_norm + 1e-6));
    for (ShardedParameter* p : shards_.of_optimizer(optimizer))
      if (p->stepped().grad().defined()) p->stepped().mutable_grad().mul_(coefficient);
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    check_groups_unchanged(optimizer);
    agree_on_non_finite_gradients(optimizer);
    const bool stepped = precision.optimizer_step(optimizer);
    if (stepped && sharding_.offload_optimizer) upload_stepped_rows(optimizer);
    if (stepped && sharding_.zero_stage == 3)
      units_.after_step();
    else if (stepped)
      shards_.gather_parameters(group_);  // all sharded parameters: the flat buffer spans every optimizer's
    units_.report_traffic();
    report_muon_traffic();
    return stepped;
  }

  // ---- blocks (stage 3): fulgur::BlockHooks ----------------------------------------------------

  at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input,
                       const fulgur::BlockForward& forward) override {
    return units_.run_block(block, input, forward);
  }
  void gather_full_parameters(torch::nn::Module&) override { units_.hold_full_parameters(); }
  void release_full_parameters(torch::nn::Module&) override { units_.release_full_parameters(); }

  // ---- state: full tensors, gathered, in torch.optim's layout; or each rank's rows (fsdp_state.h)

  c10::IValue module_state_dict(torch::nn::Module& module) override {
    if (sharded_checkpoints_) return fulgur::fsdp::sharded_module_state(module, shards_, placements_);
    if (sharding_.zero_stage != 3) return ProcessGroupStrategy::module_state_dict(module);
    // Stage 3: the whole parameters, gathered (a collective) and copied (their storage is freed again).
    fulgur::FullParameters whole(module);
    return fulgur::fsdp::with_copied_tensors(ProcessGroupStrategy::module_state_dict(module));
  }

  void save_checkpoint(const fulgur::CheckpointParts& parts, const std::string& path) override {
    if (!sharded_checkpoints_) {
      ProcessGroupStrategy::save_checkpoint(parts, path);
      return;
    }
    if (fulgur::is_storage_url(path)) {
      fulgur::fsdp::save_to_storage(path, fulgur::join_checkpoint(parts), placements_, cluster_.global_rank,
                                    cluster_.world_size, string_broadcast());
      return;
    }
    fulgur::dcp::save(path, fulgur::join_checkpoint(parts), placements_, communicator_.get());
  }

  // [trainer] async_checkpoint (fulgur/async_save.h). The full-state file is ProcessGroupStrategy's
  // (rank 0 writes it in the background). A sharded save is split in three, on disk (dcp_async.h)
  // or object storage (dcp_storage.h): each rank writes its data file in the background, and the
  // metadata that makes the checkpoint one comes last, in finish_save.
  std::function<void()> prepare_save(const fulgur::CheckpointParts& parts, const std::string& path) override {
    if (!sharded_checkpoints_) return ProcessGroupStrategy::prepare_save(parts, path);
    if (fulgur::is_storage_url(path)) {
      auto save = std::make_shared<fulgur::fsdp::SplitStorageSave>(path, cluster_.global_rank, cluster_.world_size,
                                                                   string_broadcast());
      pending_finish_[path] = [this, save](bool all_written) { save->finish(all_written, string_broadcast()); };
      return [save, parts, placements = placements_] { save->write(fulgur::join_checkpoint(parts), placements); };
    }
    auto save = std::make_shared<fulgur::fsdp::SplitDcpSave>(path, cluster_.global_rank, cluster_.world_size,
                                                             string_broadcast());
    pending_finish_[path] = [this, save](bool all_written) { save->finish(all_written, string_broadcast()); };
    return [save, parts, placements = placements_] { save->write(fulgur::join_checkpoint(parts), placements); };
  }

  void finish_save(const std::string& path, bool all_written) override {
    const auto it = pending_finish_.find(path);
    if (it == pending_finish_.end()) return;  // full-state: nothing to complete
    const std::function<void(bool)> finish = std::move(it->second);
    pending_finish_.erase(it);
    finish(all_written);
  }

  // A sharded checkpoint on object storage is a prefix whose .metadata marks it complete.
  bool is_checkpoint(const std::string& path) const override {
    if (fulgur::is_storage_url(path) && fulgur::fsdp::is_stored_checkpoint(path)) return true;
    return ProcessGroupStrategy::is_checkpoint(path);
  }

  void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                              const std::string& origin) override {
    if (sharding_.zero_stage != 3) {
      // The shards are views of the parameters, which load in place: they follow the new weights.
      fulgur::load_module_state_dict(module, state, strict, origin);
    } else if (fulgur::fsdp::holds_rows(state, shards_)) {
      fulgur::fsdp::load_module_rows(module, state, strict, origin, shards_, cluster_.global_rank);
      units_.refresh_whole();  // whole copies held now are stale: gathered again from the new shards
    } else {
      fulgur::FullParameters whole(module);
      fulgur::load_module_state_dict(module, state, strict, origin);
      torch::NoGradGuard no_grad;
      for (ShardedParameter* p : shards_.ordered)
        p->shard.copy_(p->rows_of(p->full_alias, p->begin, p->local_rows()).reshape(p->shard_shape()));
    }
    // The host copies the optimizer steps follow the loaded weights.
    torch::NoGradGuard no_grad;
    for (ShardedParameter* p : shards_.ordered)
      if (p->host.defined()) p->host.copy_(p->shard);
  }

  // Stage 3 and a sharded checkpoint: each rank reads its rows of the parameters and of their
  // optimizer state, not the whole tensors (Strategy::load_checkpoint would read every tensor whole
  // on every rank); the loaders take row-shaped tensors as they come.
  void load_checkpoint(const std::string& path, const fulgur::CheckpointParts& out) override {
    if (fulgur::is_storage_url(path) && fulgur::fsdp::is_stored_checkpoint(path)) {
      // Every rank reads from a local copy (the DCP reader reads byte ranges of local files).
      const fulgur::fsdp::StagedCheckpoint staged(path);
      load_checkpoint(staged.path(), out);
      return;
    }
    if (sharding_.zero_stage != 3 || !fulgur::dcp::is_distributed_checkpoint(path)) {
      ProcessGroupStrategy::load_checkpoint(path, out);
      return;
    }
    fulgur::fsdp::read_local_rows(path, out, shards_, cluster_.global_rank);
  }

  c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer) override {
    const std::vector<ShardedParameter*>& order = shards_.of_optimizer(optimizer);
    if (archived(optimizer)) return whole_archived_state(optimizer, order);
    c10::IValue local = fulgur::optimizer_state_dict(optimizer);
    if (!sharded_checkpoints_) return fulgur::fsdp::gathered_optimizer_state(local, order, group_);
    const auto position = std::find(shards_.optimizers.begin(), shards_.optimizers.end(), &optimizer);
    return fulgur::fsdp::sharded_optimizer_state(local, order, position - shards_.optimizers.begin(), placements_);
  }

  void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                 const std::string& origin) override {
    const std::vector<ShardedParameter*>& order = shards_.of_optimizer(optimizer);
    if (archived(optimizer)) {
      fulgur::load_optimizer_state_dict(optimizer, state, origin);
      cut_archived_state(optimizer, order, origin);
      return;
    }
    fulgur::load_optimizer_state_dict(optimizer, fulgur::fsdp::local_optimizer_state(state, order, origin), origin);
  }

 private:
  // broadcast_string, or the identity in a process of its own.
  fulgur::fsdp::BroadcastString string_broadcast() {
    return
        [this](const std::string& value, int64_t src) { return communicator_ ? broadcast_string(value, src) : value; };
  }

  ShardedParameter& shard_of(const at::Tensor& parameter) {
    return shards_.of(parameter, group_, /*own_storage=*/sharding_.zero_stage == 3);
  }

  // offload_optimizer: this rank's rows in host memory, pinned when they come from a cuda device
  // (copies to and from pinned memory are DMA transfers, without a staging copy).
  at::Tensor host_copy(const at::Tensor& shard) const {
    torch::NoGradGuard no_grad;
    return at::empty(shard.sizes(), shard.options().device(at::kCPU).pinned_memory(device_.is_cuda())).copy_(shard);
  }

  // After the optimizer stepped the host copies: the device shards take the new rows (what the
  // all-gathers, the model's stage-1/2 parameters and sharded checkpoints read).
  void upload_stepped_rows(torch::optim::Optimizer& optimizer) {
    torch::NoGradGuard no_grad;
    for (ShardedParameter* p : shards_.of_optimizer(optimizer))
      if (p->host.defined() && p->trainable) p->shard.copy_(p->host);
  }

  void report_offload() {
    int64_t bytes = 0;
    for (ShardedParameter* p : shards_.ordered)
      if (p->host.defined()) bytes += static_cast<int64_t>(p->host.nbytes());
    if (device_.is_cpu() && cluster_.global_rank == 0)
      fulgur::log::warn(
          fmt::format("strategy 'fsdp': offload_optimizer = true on {}: the parameters already live in host memory, "
                      "so the optimizer steps copies of this rank's rows there ({} bytes more) and saves nothing; it "
                      "is meant for an accelerator with its own memory",
                      device_.str(), bytes));
    if (fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(
          fmt::format("strategy 'fsdp': rank {} steps its rows in host memory (offload_optimizer): {} "
                      "bytes of parameters, a copy apart from the model's on {}",
                      cluster_.global_rank, bytes, device_.str()));
  }

  // Stage 3, a later stage of the same model: the shards stay (blocks' parameters hold no storage,
  // the others are whole and current), everything that maps them is made again by setup_module.
  void keep_shards_for_next_stage() {
    if (shards_.by_tensor.empty()) return;
    units_.drain_prefetches();
    for (auto& [impl, p] : shards_.by_tensor) {
      // Back to the model's dtype (freed storage: nothing is read), so that the precision's
      // conversion of the whole model leaves it alone; run_block casts to param_dtype again.
      if (p.in_block && sharding_.param_dtype && !p.materialised) fulgur::fsdp::set_storage_dtype(p, shards_.dtype);
      p.in_block = false;
      p.reduced = false;
      p.host.reset();  // setup_optimizers copies the rows again for a stage that steps
    }
    if (fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(fmt::format("strategy 'fsdp': rank {} keeps the shards of the previous stage ({} parameters)",
                                     cluster_.global_rank, shards_.by_tensor.size()));
    forget_mappings();  // setup_module sees no ordered shards: nothing to make whole
  }

  // Stage 3, a model set up again without configure_model in between: its shards made whole
  // again and forgotten.
  void forget_shards() {
    if (!shards_.by_tensor.empty()) units_.gather_group(shards_.ordered);
    shards_.by_tensor.clear();
    forget_mappings();
  }

  // Everything that refers to the shards (setup_module and setup_optimizers make it again).
  void forget_mappings() {
    shards_.by_optimizer.clear();
    shards_.ordered.clear();
    shards_.named.clear();
    units_.clear();
  }

  static void check_supported(torch::optim::Optimizer& optimizer) {
    // Element-wise optimizers: their update of a row depends on that row alone, so stepping
    // shards equals stepping the whole (LBFGS and friends need the whole vector). Muon's
    // matrices are gathered for Newton-Schulz (connect_muon).
    if (dynamic_cast<torch::optim::Adam*>(&optimizer) || dynamic_cast<torch::optim::AdamW*>(&optimizer) ||
        dynamic_cast<torch::optim::SGD*>(&optimizer) || dynamic_cast<fulgur::optim::Lion*>(&optimizer) ||
        dynamic_cast<fulgur::optim::Muon*>(&optimizer))
      return;
    throw Error(ErrorKind::config,
                "strategy 'fsdp': shards the state of Adam, AdamW, SGD, fulgur::optim::Lion and "
                "fulgur::optim::Muon; configure_optimizers returned another optimizer (use ddp for it)");
  }

  // ---- Lion's and Muon's state ----------------------------------------------------------------
  // The SDK keeps the state of optimizers other than Adam, AdamW and SGD as LibTorch's archive of
  // the optimizer (one opaque blob), whose tensors here would be this rank's rows. So for these
  // the strategy gathers the rows into whole tensors around the save, and cuts this rank's rows
  // out of the whole tensors after a load: the file is the one a single process writes, and it
  // loads under any strategy and world size.

  static bool archived(const torch::optim::Optimizer& optimizer) {
    return dynamic_cast<const fulgur::optim::Lion*>(&optimizer) || dynamic_cast<const fulgur::optim::Muon*>(&optimizer);
  }

  // The per-element tensors of a Lion or Muon parameter state (undefined ones included).
  static std::vector<at::Tensor*> state_tensors(torch::optim::OptimizerParamState& state) {
    if (auto* lion = dynamic_cast<fulgur::optim::LionParamState*>(&state)) return {&lion->exp_avg()};
    if (auto* muon = dynamic_cast<fulgur::optim::MuonParamState*>(&state))
      return {&muon->momentum_buffer(), &muon->exp_avg(), &muon->exp_avg_sq()};
    return {};
  }

  // Collectives in the param groups' order (every rank holds state for the same parameters: they
  // stepped together); rank zero's result is the one saved.
  c10::IValue whole_archived_state(torch::optim::Optimizer& optimizer, const std::vector<ShardedParameter*>& order) {
    std::vector<std::pair<at::Tensor*, at::Tensor>> rows;  // swapped out, put back afterwards
    for (ShardedParameter* p : order) {
      auto found = optimizer.state().find(p->stepped().unsafeGetTensorImpl());
      if (found == optimizer.state().end()) continue;
      for (at::Tensor* t : state_tensors(*found->second))
        if (t->defined()) {
          rows.emplace_back(t, *t);
          *t = fulgur::fsdp::gather_rows(*p, *t, group_).to(t->device());
        }
    }
    c10::IValue whole;
    try {
      whole = fulgur::optimizer_state_dict(optimizer);
    } catch (...) {
      for (auto& [t, mine] : rows) *t = mine;
      throw;
    }
    for (auto& [t, mine] : rows) *t = mine;
    return whole;
  }

  void cut_archived_state(torch::optim::Optimizer& optimizer, const std::vector<ShardedParameter*>& order,
                          const std::string& origin) {
    torch::NoGradGuard no_grad;
    for (ShardedParameter* p : order) {
      auto found = optimizer.state().find(p->stepped().unsafeGetTensorImpl());
      if (found == optimizer.state().end()) continue;
      for (at::Tensor* t : state_tensors(*found->second)) {
        if (!t->defined() || t->sizes() == p->stepped().sizes()) continue;  // rows already (one rank)
        if (t->numel() != p->full.numel())
          throw Error(ErrorKind::checkpoint,
                      fmt::format("{}: an optimizer state tensor of {} elements for a parameter of {} (shape {}); "
                                  "the checkpoint belongs to another model",
                                  origin, t->numel(), p->full.numel(), fmt::join(p->full.sizes(), "x")));
        *t = p->rows_of(t->to(p->stepped().device()), p->begin, p->local_rows()).clone().reshape(p->shard_shape());
      }
    }
  }

  // Muon's matrices, now row shards: Newton-Schulz gathers each (MuonRowShard), counting bytes.
  void connect_muon(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) {
    disconnect_muon();
    muon_rows_.clear();
    for (auto& optimizer : optimizers) {
      auto* muon = dynamic_cast<fulgur::optim::Muon*>(optimizer.get());
      if (!muon) continue;
      for (ShardedParameter* p : shards_.of_optimizer(*optimizer)) {
        if (p->full.dim() != 2) continue;  // an AdamW group's parameter (Muon refuses others in its groups)
        fulgur::optim::MuonRowShard& rows = muon_rows_[p->stepped().unsafeGetTensorImpl()];
        rows.first_row = p->begin;
        rows.rows = p->full.size(0);
        rows.cols = p->full.size(1);
        rows.gather = [this, p](const at::Tensor& local) {
          const int64_t bytes = p->chunk_numel() * static_cast<int64_t>(local.element_size());
          ++muon_traffic_.matrices;
          muon_traffic_.sent += group_.world_size > 1 ? bytes : 0;
          muon_traffic_.received += (group_.world_size - 1) * bytes;
          return fulgur::fsdp::gather_rows(*p, local, group_).to(local.device());
        };
      }
      muon->set_row_shards([this](const at::Tensor& param) -> const fulgur::optim::MuonRowShard* {
        auto found = muon_rows_.find(param.unsafeGetTensorImpl());
        return found == muon_rows_.end() ? nullptr : &found->second;
      });
      muons_.emplace_back(optimizer);
    }
  }

  // The optimizers outlive the strategy's fit: they must not call into it afterwards.
  void disconnect_muon() {
    for (const auto& held : muons_)
      if (auto optimizer = held.lock()) static_cast<fulgur::optim::Muon&>(*optimizer).set_row_shards(nullptr);
    muons_.clear();
  }

  void report_muon_traffic() {
    if (muon_traffic_.matrices == 0) return;
    if (fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(fmt::format(
          "strategy 'fsdp': rank {} gathered {} Muon matrices for Newton-Schulz in this step: sent {} bytes, "
          "received {} bytes (bfloat16 rows)",
          cluster_.global_rank, muon_traffic_.matrices, muon_traffic_.sent, muon_traffic_.received));
    muon_traffic_ = {};
  }

  // A parameter added to the optimizer after setup_optimizers (a param group a finetuning callback
  // adds) would be stepped whole on every rank and be missing from the gathered state: refused.
  void check_groups_unchanged(torch::optim::Optimizer& optimizer) const {
    size_t count = 0;
    for (const auto& group : optimizer.param_groups()) count += group.params().size();
    if (count != shards_.of_optimizer(optimizer).size())
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': the optimizer now holds {} parameters, {} when training started; "
                              "parameters added later (a callback that unfreezes layers into a new param group) "
                              "are not sharded; put every parameter in configure_optimizers (frozen ones are "
                              "fine) or use ddp / single_device",
                              count, shards_.of_optimizer(optimizer).size()));
  }

  // A loss scaler skips a step with inf/NaN gradients; with sharded gradients only some ranks
  // see them, so the decision is taken together: a rank without any marks one of its own.
  void agree_on_non_finite_gradients(torch::optim::Optimizer& optimizer) {
    if (!communicator_) return;
    bool local = false;
    at::Tensor* mark = nullptr;
    for (ShardedParameter* p : shards_.of_optimizer(optimizer)) {
      at::Tensor& grad = p->stepped().mutable_grad();
      if (!grad.defined() || grad.numel() == 0) continue;
      if (!mark) mark = &grad;
      if (!grad.isfinite().all().item<bool>()) local = true;
    }
    if (!reduce_boolean_decision(local, /*all=*/false) || local || !mark) return;
    mark->view(-1)[0] = std::numeric_limits<double>::quiet_NaN();
  }

  // Stage 3, at the first backward (the training forward has claimed every unit it runs): how much
  // of the model is sharded, said at the default log level, and refused when nothing is, which
  // would be ZeRO-2 under another name.
  void check_units() {
    units_checked_ = true;
    int64_t total = 0, sharded = 0;
    std::vector<std::string> whole;
    std::set<const ShardedParameter*> seen;  // a tied parameter counts once
    for (const auto& [name, p] : shards_.named) {
      if (!seen.insert(p).second) continue;
      total += p->full.numel();
      if (p->in_block)
        sharded += p->full.numel();
      else
        whole.push_back(name);
    }
    const int64_t units = units_.unit_count();
    if (sharded == 0 && total > 0 && auto_wrap_.kind != fulgur::fsdp::AutoWrapPolicy::Kind::root) {
      whole.resize(std::min<size_t>(whole.size(), 5));
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': zero_stage = 3 would shard none of the model's {} parameters ({} "
                              "tensors: {}{}): no fulgur::run_block block and no auto-wrapped submodule holds "
                              "them, so every rank would keep them whole (ZeRO-2's memory). Run the model's layers "
                              "through fulgur::run_block (fulgur/blocks.h), or set [strategy] auto_wrap_policy = "
                              "\"size\" or \"modules\" for layers held in a torch::nn::Sequential, or accept "
                              "whole parameters with auto_wrap_policy = \"root\", or use zero_stage = 2",
                              total, seen.size(), fmt::join(whole, ", "), seen.size() > whole.size() ? ", ..." : ""));
    }
    if (cluster_.global_rank != 0) return;
    const double percent = total > 0 ? 100.0 * static_cast<double>(sharded) / static_cast<double>(total) : 0.0;
    std::string rest;
    if (!whole.empty()) {
      const size_t n = whole.size();
      whole.resize(std::min<size_t>(n, 3));
      rest = fmt::format(
          "; {} parameters in {} tensors outside units ({}{}) stay whole on every rank, as FSDP's "
          "root unit",
          total - sharded, n, fmt::join(whole, ", "), n > whole.size() ? ", ..." : "");
    }
    fulgur::log::info(
        fmt::format("strategy 'fsdp': zero_stage = 3 shards {} of {} parameters ({:.1f}%) in {} units "
                    "({} auto-wrapped){}",
                    sharded, total, percent, units, auto_wrapped_, rest));
  }

  // ---- options ---------------------------------------------------------------------------------

  static fulgur::fsdp::AutoWrapPolicy parse_auto_wrap(const Options& options,
                                                      const fulgur::fsdp::ShardingOptions& sharding) {
    using Kind = fulgur::fsdp::AutoWrapPolicy::Kind;
    fulgur::fsdp::AutoWrapPolicy policy;
    const std::string& kind = options.auto_wrap_policy;
    if (kind == "blocks")
      policy.kind = Kind::blocks;
    else if (kind == "root")
      policy.kind = Kind::root;
    else if (kind == "size")
      policy.kind = Kind::size;
    else if (kind == "modules")
      policy.kind = Kind::modules;
    else
      options.reject("auto_wrap_policy",
                     "is not known; use \"blocks\" (the Module's run_block blocks), \"root\" (the same; parameters "
                     "outside them may stay whole), \"size\" (with auto_wrap_min_params) or \"modules\" (with "
                     "auto_wrap_modules)");
    policy.min_params = options.auto_wrap_min_params;
    policy.modules = options.auto_wrap_modules;
    options.check(policy.min_params >= 1, "auto_wrap_min_params", "must be >= 1");
    options.check(sharding.zero_stage == 3 || kind == "blocks", "auto_wrap_policy",
                  fmt::format("applies to zero_stage = 3 (sharded parameters); stage {} keeps whole parameters: "
                              "remove the option",
                              sharding.zero_stage));
    options.check(policy.kind == Kind::modules || policy.modules.empty(), "auto_wrap_modules",
                  "applies to auto_wrap_policy = \"modules\": set it, or remove auto_wrap_modules");
    options.check(policy.kind != Kind::modules || !policy.modules.empty(), "auto_wrap_policy",
                  "needs auto_wrap_modules: the module classes that become units (e.g. [\"Linear\"])");
    return policy;
  }

  static std::optional<at::ScalarType> parse_dtype(const Options& options, const char* option,
                                                   const std::string& value) {
    if (value == "auto") return std::nullopt;
    if (value == "float32") return at::kFloat;
    if (value == "bfloat16") return at::kBFloat16;
    if (value == "float16") return at::kHalf;
    if (value == "float64") return at::kDouble;
    options.reject(option, "is not known; use \"auto\", \"float32\", \"bfloat16\", \"float16\" or \"float64\"");
  }

  static bool parse_state_dict_type(const Options& options) {
    const std::string& value = options.state_dict_type;
    if (value == "full") return false;
    if (value == "sharded") return true;
    options.reject("state_dict_type",
                   "is not known; use \"full\" (one file, gathered on rank 0) or \"sharded\" (a directory, every "
                   "rank writing its rows)");
  }

  // The options that shape sharding, checked against each other: the stage-3 ones are refused
  // for the other stages.
  static fulgur::fsdp::ShardingOptions parse_sharding(const Options& options) {
    fulgur::fsdp::ShardingOptions s;
    s.zero_stage = options.zero_stage;
    s.reshard_after_forward = options.reshard_after_forward;
    s.prefetch = options.prefetch;
    s.offload_optimizer = options.offload_optimizer;
    s.overlap_reduce = options.overlap_reduce;
    const double bucket_mb = options.reduce_bucket_mb;
    options.check(std::isfinite(bucket_mb) && bucket_mb > 0 && bucket_mb <= 1 << 20, "reduce_bucket_mb",
                  "must be a number of MiB above 0 (at most 1048576); 25 is DDP's default");
    s.reduce_bucket_bytes = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20)));
    s.reduce_dtype = parse_dtype(options, "reduce_dtype", options.reduce_dtype);
    s.param_dtype = parse_dtype(options, "param_dtype", options.param_dtype);
    options.check(s.zero_stage >= 1 && s.zero_stage <= 3, "zero_stage",
                  "is not a ZeRO stage; use 1 (sharded optimizer state), 2 (and gradients) or 3 (and parameters)");
    options.check(s.zero_stage == 3 || s.prefetch, "prefetch",
                  fmt::format("applies to zero_stage = 3 (sharded parameters); stage {} gathers nothing ahead: remove "
                              "the option",
                              s.zero_stage));
    if (s.zero_stage != 3 && s.param_dtype)
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': param_dtype = \"{}\" applies to zero_stage = 3, which gathers the "
                              "blocks' parameters for each use; stage {} keeps the model's parameters whole: "
                              "use bf16-mixed precision (autocast) or reduce_dtype instead",
                              c10::toString(*s.param_dtype), s.zero_stage));
    options.check(s.zero_stage != 3 || bucket_mb == 25.0, "reduce_bucket_mb",
                  "applies to zero_stage = 1 and 2; stage 3 reduces each block's gradients as one bucket: remove "
                  "the option");
    options.check(s.overlap_reduce || bucket_mb == 25.0, "reduce_bucket_mb",
                  "applies with overlap_reduce = true only (without it the gradients travel in one collective after "
                  "backward): remove the option or the overlap_reduce = false");
    options.check(s.zero_stage == 3 || s.reshard_after_forward, "reshard_after_forward",
                  fmt::format("applies to zero_stage = 3 (sharded parameters); stage {} keeps whole parameters "
                              "anyway: remove the option",
                              s.zero_stage));
    return s;
  }

  const bool sharded_checkpoints_;  // state_dict_type = "sharded"
  const fulgur::fsdp::ShardingOptions sharding_;
  const fulgur::fsdp::AutoWrapPolicy auto_wrap_;
  int64_t auto_wrapped_ = 0;       // stage 3: submodules the policy routes through run_block
  bool units_checked_ = true;      // stage 3: check_units ran since setup_module
  fulgur::fsdp::RankGroup group_;  // communicator_, cluster_ and device_ as setup_environment left them
  fulgur::fsdp::Shards shards_;
  fulgur::fsdp::Zero3Units units_{shards_, sharding_, group_};
  fulgur::fsdp::GradientBuckets buckets_{sharding_, group_};  // stages 1 and 2 with overlap_reduce
  fulgur::fsdp::Placements placements_;                       // of the state dicts made for the next save
  // Muon: each matrix's rows by the tensor the optimizer steps, the optimizers that read them, and
  // what their gathers moved since the last step.
  std::map<const c10::TensorImpl*, fulgur::optim::MuonRowShard> muon_rows_;
  std::vector<std::weak_ptr<torch::optim::Optimizer>> muons_;
  // [trainer] async_checkpoint: the sharded saves prepared and not yet finished, by path.
  std::map<std::string, std::function<void(bool all_written)>> pending_finish_;
  struct {
    int64_t matrices = 0, sent = 0, received = 0;
  } muon_traffic_;
  // Stage 3, while configure_model runs: how the Trainer prepares a block (device, precision).
  const fulgur::ModelBuild* building_ = nullptr;
  int64_t built_blocks_ = 0, built_bytes_ = 0, largest_built_bytes_ = 0;
};

}  // namespace

FULGUR_PLUGIN(
    FsdpStrategy, "fsdp", "0.2.0",
    "Sharded data parallel (ZeRO-1/2/3): optimizer state, with stage 2 gradients, with stage 3 parameters split "
    "across ranks (stage 3 gathers each fulgur::run_block block's parameters around its forward and backward); "
    "checkpoints hold the full state and load under any world size")
