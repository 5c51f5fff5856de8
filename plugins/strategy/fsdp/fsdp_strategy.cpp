// Built-in strategy `fsdp`: sharded data parallel, ZeRO stages 1, 2 and 3, one process per device.
//
// Every parameter the optimizers step is split on dim 0 into world_size chunks of
// ceil(rows / world_size) rows, FSDP2's layout (the last ranks' chunks may be short or empty; a
// 0-dim parameter is one row, owned by rank 0). Each rank's optimizer steps only its own rows
// ("shards": views of those rows that replace the parameters in the optimizer's param groups, so
// LR schedulers and param-group indices stay as configure_optimizers made them); its optimizer
// state (Adam's two moments, SGD's momentum) therefore exists for 1/world_size of the model.
//
//   zero_stage = 1  gradients are all-reduced, each rank keeps its rows of them   8Ψ + 8Ψ/N bytes*
//   zero_stage = 2  gradients are reduce-scattered: each rank receives only its rows 4Ψ + 12Ψ/N
//   zero_stage = 3  parameters are sharded too: whole only around the blocks that use them  16Ψ/N
//   (* fp32 parameters and Adam, Ψ parameters, N ranks; DeepSpeed's accounting)
//
// Stages 1 and 2: after the step, one all-gather of the updated rows refreshes the full
// parameters, which every rank keeps for forward and backward.
//
// Stage 3: the shards are tensors of their own and the parameters' storage is freed (their shape
// stays, so autograd and the Module see the same parameters). The blocks a Module runs through
// fulgur::run_block (fulgur/blocks.h) are the units: before a block's forward one all-gather makes
// its parameters whole, after it they are freed again (reshard_after_forward); a hook on the
// block's output gathers them again when backward reaches it, and an identity autograd node on its
// input reduce-scatters their gradients as soon as the block's backward is done (the engine runs
// the parameters' gradient accumulation before that node). What no hook saw (the first block, whose
// input needs no gradient; parameters outside any block) is reduce-scattered at the end of
// backward in one collective. Parameters outside blocks stay whole, as in stage 2. Clipping by
// norm uses the global norm across shards, and a skipped step (inf/NaN gradients under a loss
// scaler) is skipped on every rank together. Checkpoints hold the full, unsharded model and
// optimizer state in torch.optim's layout, gathered on rank zero (state_dict_type = "full"), or
// each rank's rows in a torch.distributed.checkpoint directory ("sharded"), which stage 3 reads
// back row by row; both load under any world size and any strategy.
//
// offload_optimizer (ZeRO-Offload): the optimizer steps a host-memory copy of this rank's rows
// (pinned when the device is cuda), so its state (Adam's 8 bytes per parameter) never occupies the
// device. Reduced gradients land in host memory in one copy per collective; after the step the
// updated rows go back to the device shards, which the all-gathers and checkpoints read as before.
#include <fulgur/blocks.h>
#include <fulgur/communicator.h>
#include <fulgur/distributed_checkpoint.h>
#include <fulgur/log.h>
#include <fulgur/plugin.h>
#include <fulgur/state_dict.h>
#include <fulgur/strategy.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../common/process_group_strategy.h"

namespace {

using fulgur::Error;
using fulgur::ErrorKind;

// One parameter as the strategy shards it.
struct ShardedParameter {
  at::Tensor full;   // the module's parameter (whole on every rank in stages 1 and 2)
  at::Tensor shard;  // a view of this rank's rows of it: the tensor the optimizer steps, in place
  at::Tensor host;   // offload_optimizer: a copy of the shard in host memory, stepped instead
  int64_t rows = 1, chunk_rows = 1, row_numel = 1;
  int64_t begin = 0, end = 0;  // this rank's rows [begin, end)
  int64_t flat_offset = 0;     // its padded chunk's place in one rank's slice of the flat buffers
  bool trainable = true;       // frozen parameters (requires_grad false) never get gradients
  // Stage 3 only.
  at::Tensor full_alias;     // full's storage through a tensor with its own version counter: a
                             // gather writes through it without invalidating what autograd saved
  size_t full_nbytes = 0;    // the storage's size when whole
  bool materialised = true;  // full's storage holds the current values (false: freed)
  bool in_block = false;     // a block claimed it (else it stays whole, like stage 2)
  bool reduced = false;      // its gradient was reduce-scattered during the current backward

  int64_t local_rows() const { return end - begin; }
  int64_t chunk_numel() const { return chunk_rows * row_numel; }
  // Rows [first, first + count) of a tensor shaped like the parameter, as [count, row_numel].
  at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t count) const {
    return t.reshape({rows, row_numel}).narrow(0, first, count);
  }
  // The tensor the optimizer steps and whose gradient the collectives fill.
  at::Tensor& stepped() { return host.defined() ? host : shard; }
  const at::Tensor& stepped() const { return host.defined() ? host : shard; }
  // Whether `t` is this rank's rows of the parameter rather than the whole of it (as a stage-3
  // rank reads them from a sharded checkpoint).
  bool is_local_rows(const at::Tensor& t) const {
    return full.dim() > 0 && local_rows() < rows && t.sizes().vec() == shard_shape();
  }
  // The shape of this rank's rows (a 0-dim parameter: 0-dim on its owner, {0} elsewhere).
  std::vector<int64_t> shard_shape() const {
    if (full.dim() == 0) return local_rows() == 1 ? std::vector<int64_t>{} : std::vector<int64_t>{0};
    std::vector<int64_t> shape(full.sizes().begin(), full.sizes().end());
    shape[0] = local_rows();
    return shape;
  }
};

// Stage 3: an identity on a block's input whose backward runs once the block's backward is done
// (the engine accumulates the parameters' gradients before it), which is when the block's
// gradients can be reduce-scattered and its parameters freed.
struct AfterBlock : torch::CustomClassHolder {
  std::function<void()> run;
};

struct AfterBlockBackward : torch::autograd::Function<AfterBlockBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            c10::intrusive_ptr<AfterBlock> after) {
    ctx->saved_data["after"] = c10::IValue::make_capsule(std::move(after));
    return input;  // autograd makes it a view of the input with this node as its history
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    c10::static_intrusive_pointer_cast<AfterBlock>(ctx->saved_data["after"].toCapsule())->run();
    return {grad_outputs[0], at::Tensor()};
  }
};

class FsdpStrategy final : public fulgur::strategy_support::ProcessGroupStrategy, public fulgur::BlockHooks {
 public:
  explicit FsdpStrategy(const fulgur::Options& options)
      : ProcessGroupStrategy("fsdp", options),
        zero_stage_(options.get_int("zero_stage")),
        reshard_after_forward_(options.get_bool("reshard_after_forward")),
        prefetch_(options.get_bool("prefetch")),
        sharded_checkpoints_(parse_state_dict_type(options.get_string("state_dict_type"))),
        offload_optimizer_(options.get_bool("offload_optimizer")),
        reduce_dtype_(parse_dtype("reduce_dtype", options.get_string("reduce_dtype"))),
        param_dtype_(parse_dtype("param_dtype", options.get_string("param_dtype"))) {
    if (zero_stage_ < 1 || zero_stage_ > 3)
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': zero_stage = {} is not a ZeRO stage; use 1 (sharded optimizer "
                              "state), 2 (and gradients) or 3 (and parameters)",
                              zero_stage_));
    if (zero_stage_ != 3 && !prefetch_)
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': prefetch = false applies to zero_stage = 3 (sharded parameters); "
                              "stage {} gathers nothing ahead: remove the option",
                              zero_stage_));
    if (zero_stage_ != 3 && param_dtype_)
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': param_dtype = \"{}\" applies to zero_stage = 3, which gathers the "
                              "blocks' parameters for each use; stage {} keeps the model's parameters whole: "
                              "use bf16-mixed precision (autocast) or reduce_dtype instead",
                              c10::toString(*param_dtype_), zero_stage_));
    if (zero_stage_ != 3 && !reshard_after_forward_)
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': reshard_after_forward = false applies to zero_stage = 3 (sharded "
                              "parameters); stage {} keeps whole parameters anyway: remove the option",
                              zero_stage_));
  }
  ~FsdpStrategy() override { fulgur::remove_block_hooks(this); }

  // Stage 3: blocks the Module marks with fulgur::built_block while it builds are sharded at once
  // (block_built below), so a rank holds its shards and one whole block, never the whole model.
  void configure_model(torch::nn::Module& module, const fulgur::ModelBuild& build) override {
    if (zero_stage_ != 3) {
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
      for (const auto& [impl, p] : shards_) kept += static_cast<int64_t>(p.shard.nbytes());
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
      if (shards_.contains(parameter.unsafeGetTensorImpl())) continue;  // a nested block's, sharded already
      ShardedParameter& p = shard_of(parameter);
      bytes += static_cast<int64_t>(p.full_nbytes);
      release(p);
    }
    ++built_blocks_;
    built_bytes_ += bytes;
    largest_built_bytes_ = std::max(largest_built_bytes_, bytes);
  }

  void setup_module(torch::nn::Module& module) override {
    // Stage 3 keeps what configure_model sharded; a model set up before without configure_model
    // in between is made whole first.
    if (zero_stage_ == 3 && !ordered_.empty()) forget_shards();
    if (zero_stage_ != 3) shards_.clear();
    forget_mappings();
    module.to(device_);
    if (communicator_) {
      // Every rank starts from rank 0's weights and buffers, as under ddp (the blocks sharded as
      // they were built are rank 0's already, and hold no storage to send).
      std::vector<at::Tensor> state;
      for (auto& p : module.parameters())
        if (!shards_.contains(p.unsafeGetTensorImpl())) state.push_back(p);
      for (auto& b : module.buffers()) state.push_back(b);
      communicator_->broadcast_coalesced(state, 0);
    }
    if (zero_stage_ == 3) {
      // Every parameter is sharded, in the optimizers or not (frozen ones take memory too), in
      // the Module's order: the same on every rank. Blocks sharded as they were built are in
      // shards_ already; a parameter reached twice (tied) is listed once.
      std::set<const ShardedParameter*> listed;
      for (const auto& item : module.named_parameters()) {
        ShardedParameter& sharded = shard_of(item.value());
        if (listed.insert(&sharded).second) ordered_.push_back(&sharded);
        named_[item.key()] = &sharded;
      }
      // Shards kept from a previous stage of another model (a new Module for this stage) go.
      std::erase_if(shards_, [&](const auto& entry) { return !listed.contains(&entry.second); });
      fulgur::install_block_hooks(this);
    }
  }

  void teardown() override {
    fulgur::remove_block_hooks(this);
    ProcessGroupStrategy::teardown();
  }

  // The optimizers step this rank's rows: each parameter in their groups is swapped for its shard.
  void setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) override {
    if (zero_stage_ != 3) {
      shards_.clear();
      ordered_.clear();
    }
    optimizer_shards_.clear();
    optimizer_order_.clear();
    for (auto& optimizer : optimizers) {
      check_supported(*optimizer);
      optimizer_order_.push_back(optimizer.get());
      std::vector<ShardedParameter*>& order = optimizer_shards_[optimizer.get()];
      for (auto& group : optimizer->param_groups())
        for (at::Tensor& parameter : group.params()) {
          const bool new_one = !shards_.contains(parameter.unsafeGetTensorImpl());
          if (zero_stage_ == 3 && new_one)
            throw Error(ErrorKind::config,
                        "strategy 'fsdp': configure_optimizers passed a tensor that is not a parameter of the "
                        "Module; with zero_stage = 3 the optimizers may hold only the Module's parameters");
          ShardedParameter& sharded = shard_of(parameter);
          // The collectives' layout follows the optimizers' param groups: the same order on every rank.
          if (new_one) ordered_.push_back(&sharded);
          order.push_back(&sharded);
          if (offload_optimizer_) sharded.host = host_copy(sharded.shard);
          parameter = sharded.stepped();
        }
    }
    if (offload_optimizer_) report_offload();
    layout_flat_buffers();
    all_gathers_ = reduce_scatters_ = prefetches_ = 0;
  }

  void before_training_step(bool sync_gradients) override {
    sync_gradients_ = sync_gradients;
    remember_forward_order();
  }

  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool sync_gradients) override {
    sync_gradients_ = sync_gradients;
    if (zero_stage_ == 3) {
      for (ShardedParameter* p : ordered_) p->reduced = false;
      remember_forward_order();  // backward prefetches in the reverse of the forward just run
      precision.scale_loss(loss).backward();
      finish_backward();
      return;
    }
    precision.scale_loss(loss).backward();
    // Micro-steps of an accumulation window add up locally, without communication.
    if (sync_gradients && !shards_.empty()) reduce_gradients();
  }

  // By norm: the norm of the whole gradient, across every rank's rows (torch's clip_grad_norm_).
  void clip_gradients(torch::optim::Optimizer& optimizer, fulgur::Precision& precision, double clip_value,
                      fulgur::GradClipAlgorithm algorithm) override {
    if (algorithm == fulgur::GradClipAlgorithm::value) {
      precision.clip_gradients(optimizer, clip_value, algorithm);  // element-wise: the same on shards
      return;
    }
    at::Tensor sum_of_squares = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
    for (ShardedParameter* p : shards_for(optimizer))
      if (const at::Tensor& grad = p->stepped().grad(); grad.defined() && grad.numel() > 0)
        sum_of_squares += grad.detach().to(at::kDouble).pow(2).sum().to(device_);
    if (communicator_) communicator_->all_reduce(sum_of_squares, fulgur::ReduceOp::sum);
    const double total_norm = std::sqrt(sum_of_squares.item<double>());
    const double coefficient = std::min(1.0, clip_value / (total_norm + 1e-6));
    for (ShardedParameter* p : shards_for(optimizer))
      if (p->stepped().grad().defined()) p->stepped().mutable_grad().mul_(coefficient);
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    check_groups_unchanged(optimizer);
    agree_on_non_finite_gradients(optimizer);
    const bool stepped = precision.optimizer_step(optimizer);
    if (stepped && offload_optimizer_) upload_stepped_rows(optimizer);
    if (stepped && zero_stage_ == 3) {
      // Whole copies of blocks' parameters are stale now (the next forward gathers them); the
      // parameters outside blocks are refreshed at once, as in stage 2.
      std::vector<ShardedParameter*> outside;
      for (ShardedParameter* p : ordered_) {
        if (p->in_block)
          release(*p);
        else
          outside.push_back(p);
      }
      gather_group(outside, /*refresh=*/true);
    } else if (stepped) {
      gather_parameters(optimizer);
    }
    if (fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(
          fmt::format("strategy 'fsdp': since the previous optimizer step: {} all-gathers ({} started "
                      "ahead), {} reduce-scatters ({} units)",
                      all_gathers_, prefetches_, reduce_scatters_, units_.size()));
    all_gathers_ = reduce_scatters_ = prefetches_ = 0;
    return stepped;
  }

  // ---- blocks (stage 3): fulgur::BlockHooks ----------------------------------------------------

  at::Tensor run_block(torch::nn::Module& block, const at::Tensor& input,
                       const fulgur::BlockForward& forward) override {
    Unit& unit = unit_of(block);
    if (unit.parameters.empty()) return forward(input);
    const bool with_gradients = torch::GradMode::is_enabled();
    if (with_gradients) this_forward_.push_back(&unit);
    gather_unit(unit);
    prefetch_after(unit, +1);
    at::Tensor x = input;
    if (with_gradients && input.requires_grad()) x = AfterBlockBackward::apply(input, unit_capsule(unit));
    // param_dtype: the block computes in the gathered parameters' dtype (FSDP2's cast_forward_inputs)
    // and hands its output back in the input's dtype, so the code around blocks needs no change.
    const at::ScalarType compute = unit.parameters.front()->full.scalar_type();
    const bool cast =
        param_dtype_ && compute == *param_dtype_ && input.is_floating_point() && input.scalar_type() != compute;
    if (cast) x = x.to(compute);
    at::Tensor output = forward(x);
    if (with_gradients && output.requires_grad())
      output.register_hook([this, &unit](const at::Tensor&) {
        gather_unit(unit);
        prefetch_after(unit, -1);
      });
    if ((reshard_after_forward_ || !with_gradients) && full_parameters_held_ == 0)
      for (ShardedParameter* p : unit.parameters) release(*p);
    return cast && output.is_floating_point() ? output.to(input.scalar_type()) : output;
  }

  // Whole in the shards' dtype (param_dtype is for computing, not for saving): exactly the weights
  // the optimizer steps.
  void gather_full_parameters(torch::nn::Module&) override {
    if (full_parameters_held_++ == 0 && param_dtype_) {
      drain_prefetches();
      for (ShardedParameter* p : ordered_)
        if (p->in_block) set_storage_dtype(*p, dtype_);
    }
    gather_group(ordered_);
  }
  void release_full_parameters(torch::nn::Module&) override {
    if (full_parameters_held_ > 0 && --full_parameters_held_ == 0)
      for (ShardedParameter* p : ordered_)
        if (p->in_block) {
          release(*p);
          if (param_dtype_) set_storage_dtype(*p, *param_dtype_);
        }
  }

  // ---- state: full tensors, gathered, in torch.optim's layout; or each rank's rows -------------
  //
  // state_dict_type = "full": rank zero writes one file holding whole tensors (gathered).
  // state_dict_type = "sharded": every rank writes its own rows into a DCP directory
  // (fulgur/distributed_checkpoint.h), nothing is gathered; any strategy and world size reads it back
  // (Strategy::load_checkpoint reads it whole, and the loaders below take their rows).

  c10::IValue module_state_dict(torch::nn::Module& module) override {
    if (sharded_checkpoints_) return sharded_module_state(module);
    if (zero_stage_ != 3) return ProcessGroupStrategy::module_state_dict(module);
    // Stage 3: the whole parameters, gathered (a collective) and copied (their storage is freed again).
    fulgur::FullParameters whole(module);
    const c10::IValue shared = ProcessGroupStrategy::module_state_dict(module);
    const auto entries = shared.toGenericDict();
    auto copies = c10::impl::GenericDict(entries.keyType(), entries.valueType());
    for (const auto& entry : entries)
      copies.insert(entry.key(),
                    entry.value().isTensor() ? c10::IValue(entry.value().toTensor().clone()) : entry.value());
    return copies;
  }

  void save_checkpoint(const fulgur::CheckpointParts& parts, const std::string& path) override {
    if (!sharded_checkpoints_) {
      ProcessGroupStrategy::save_checkpoint(parts, path);
      return;
    }
    fulgur::dcp::save(path, fulgur::join_checkpoint(parts), placements_, communicator_.get());
  }

  void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                              const std::string& origin) override {
    load_into_shards(module, state, strict, origin);
    // The host copies the optimizer steps follow the loaded weights.
    torch::NoGradGuard no_grad;
    for (ShardedParameter* p : ordered_)
      if (p->host.defined()) p->host.copy_(p->shard);
  }

  // Stage 3 and a sharded checkpoint: each rank reads its rows of the parameters and of their
  // optimizer state, not the whole tensors (Strategy::load_checkpoint would read every tensor whole
  // on every rank); the loaders above and below take row-shaped tensors as they come.
  void load_checkpoint(const std::string& path, const fulgur::CheckpointParts& out) override {
    if (zero_stage_ != 3 || !fulgur::dcp::is_distributed_checkpoint(path)) {
      ProcessGroupStrategy::load_checkpoint(path, out);
      return;
    }
    const fulgur::dcp::Reader reader(path);
    int64_t row_bytes = 0, whole_bytes = 0, sliced = 0;
    auto rows = [&](const ShardedParameter& p, const std::string& key) -> at::Tensor {
      if (p.full.dim() == 0 || reader.shape(key) != p.full.sizes().vec()) return {};  // whole; the loaders judge it
      std::vector<int64_t> offsets(p.full.dim(), 0), sizes = p.full.sizes().vec();
      offsets[0] = p.begin;
      sizes[0] = p.local_rows();
      at::Tensor t = reader.read(key, offsets, sizes);
      row_bytes += static_cast<int64_t>(t.nbytes());
      whole_bytes += p.full.numel() * static_cast<int64_t>(c10::elementSize(reader.dtype(key)));
      ++sliced;
      return t;
    };
    const c10::IValue whole = reader.read_all([&](const std::string& key) -> at::Tensor {
      if (key.starts_with("state_dict.")) {
        auto found = named_.find(key.substr(std::string_view("state_dict.").size()));
        return found == named_.end() ? at::Tensor() : rows(*found->second, key);
      }
      // optimizer_states.<optimizer>.state.<parameter index>.<name>; "step" is not per element.
      int64_t optimizer = -1, index = -1;
      int consumed = 0;
      if (std::sscanf(key.c_str(), "optimizer_states.%ld.state.%ld.%n", &optimizer, &index, &consumed) != 2 ||
          consumed == 0 || key.substr(consumed) == "step" || optimizer < 0 ||
          optimizer >= static_cast<int64_t>(optimizer_order_.size()))
        return {};
      const auto& order = optimizer_shards_.at(optimizer_order_[optimizer]);
      return index >= 0 && index < static_cast<int64_t>(order.size()) ? rows(*order[index], key) : at::Tensor();
    });
    if (fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(fmt::format("strategy 'fsdp': rank {} read its rows of {} tensors from {}: {} of {} bytes",
                                     cluster_.global_rank, sliced, path, row_bytes, whole_bytes));
    fulgur::split_checkpoint(whole, out, path);
    if (out.optimizer_states)
      for (c10::IValue& state : *out.optimizer_states) state = fulgur::dcp::with_index_keys(state);
  }

  c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer) override {
    c10::IValue local = fulgur::optimizer_state_dict(optimizer);
    const std::vector<ShardedParameter*>& order = shards_for(optimizer);
    if (sharded_checkpoints_) return sharded_optimizer_state(optimizer, local, order);
    return map_parameter_states(local, order,
                                [&](const ShardedParameter& p, const at::Tensor& t) { return gather_rows(p, t); });
  }

  void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                 const std::string& origin) override {
    const std::vector<ShardedParameter*>& order = shards_for(optimizer);
    c10::IValue local = map_parameter_states(state, order, [&](const ShardedParameter& p, const at::Tensor& t) {
      // This rank's rows already (read so from a sharded checkpoint under stage 3).
      if (p.is_local_rows(t)) return t.to(p.stepped().device()).clone();
      if (t.numel() != p.full.numel())
        throw Error(ErrorKind::checkpoint,
                    fmt::format("{}: an optimizer state tensor of {} elements for a parameter of {} (shape {}); the "
                                "checkpoint belongs to another model",
                                origin, t.numel(), p.full.numel(), fmt::join(p.full.sizes(), "x")));
      return p.rows_of(t.to(p.stepped().device()), p.begin, p.local_rows()).clone().reshape(p.shard_shape());
    });
    fulgur::load_optimizer_state_dict(optimizer, local, origin);
  }

 private:
  void load_into_shards(torch::nn::Module& module, const c10::IValue& state, bool strict, const std::string& origin) {
    if (zero_stage_ != 3) {
      // The shards are views of the parameters, which load in place: they follow the new weights.
      fulgur::load_module_state_dict(module, state, strict, origin);
      return;
    }
    if (holds_rows(state)) {
      load_module_rows(module, state, strict, origin);
      return;
    }
    fulgur::FullParameters whole(module);
    fulgur::load_module_state_dict(module, state, strict, origin);
    torch::NoGradGuard no_grad;
    for (ShardedParameter* p : ordered_)
      p->shard.copy_(p->rows_of(p->full_alias, p->begin, p->local_rows()).reshape(p->shard_shape()));
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
    for (ShardedParameter* p : shards_for(optimizer))
      if (p->host.defined() && p->trainable) p->shard.copy_(p->host);
  }

  void report_offload() {
    int64_t bytes = 0;
    for (ShardedParameter* p : ordered_)
      if (p->host.defined()) bytes += static_cast<int64_t>(p->host.nbytes());
    if (!device_.is_cuda() && cluster_.global_rank == 0)
      fulgur::log::warn(
          fmt::format("strategy 'fsdp': offload_optimizer = true on {}: the parameters already live in host memory, "
                      "so the optimizer steps copies of this rank's rows there ({} bytes more) and saves nothing; it "
                      "is meant for accelerator = \"cuda\"",
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
    if (shards_.empty()) return;
    drain_prefetches();
    for (auto& [impl, p] : shards_) {
      // Back to the model's dtype (freed storage: nothing is read), so that the precision's
      // conversion of the whole model leaves it alone; run_block casts to param_dtype again.
      if (p.in_block && param_dtype_ && !p.materialised) set_storage_dtype(p, dtype_);
      p.in_block = false;
      p.reduced = false;
      p.host.reset();  // setup_optimizers copies the rows again for a stage that steps
    }
    if (fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(fmt::format("strategy 'fsdp': rank {} keeps the shards of the previous stage ({} parameters)",
                                     cluster_.global_rank, shards_.size()));
    forget_mappings();  // setup_module sees ordered_ empty: nothing to make whole
  }

  // Stage 3, a model set up again without configure_model in between: its shards made whole
  // again and forgotten.
  void forget_shards() {
    if (!shards_.empty()) gather_group(ordered_);
    shards_.clear();
    forget_mappings();
  }

  // Everything that refers to the shards (setup_module and setup_optimizers make it again).
  void forget_mappings() {
    optimizer_shards_.clear();
    ordered_.clear();
    units_.clear();
    named_.clear();
    forward_order_.clear();
    this_forward_.clear();
  }

  static void check_supported(torch::optim::Optimizer& optimizer) {
    // Element-wise optimizers only: their update of a row depends on that row alone, so stepping
    // shards equals stepping the whole (LBFGS and friends need the whole vector).
    if (dynamic_cast<torch::optim::Adam*>(&optimizer) || dynamic_cast<torch::optim::AdamW*>(&optimizer) ||
        dynamic_cast<torch::optim::SGD*>(&optimizer))
      return;
    throw Error(ErrorKind::config,
                "strategy 'fsdp': shards the state of Adam, AdamW and SGD; configure_optimizers "
                "returned another optimizer (use ddp for it)");
  }

  // A parameter added to the optimizer after setup_optimizers (a param group a finetuning callback
  // adds) would be stepped whole on every rank and be missing from the gathered state: refused.
  void check_groups_unchanged(torch::optim::Optimizer& optimizer) const {
    size_t count = 0;
    for (const auto& group : optimizer.param_groups()) count += group.params().size();
    if (count != shards_for(optimizer).size())
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': the optimizer now holds {} parameters, {} when training started; "
                              "parameters added later (a callback that unfreezes layers into a new param group) "
                              "are not sharded; put every parameter in configure_optimizers (frozen ones are "
                              "fine) or use ddp / single_device",
                              count, shards_for(optimizer).size()));
  }

  ShardedParameter& shard_of(const at::Tensor& parameter) {
    auto found = shards_.find(parameter.unsafeGetTensorImpl());
    if (found != shards_.end()) return found->second;
    if (!parameter.defined() || (!shards_.empty() && parameter.scalar_type() != dtype_))
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': parameters of several dtypes ({} and {}) are not supported yet; "
                              "convert the model to one dtype (the precision plugin does)",
                              c10::toString(dtype_), c10::toString(parameter.scalar_type())));
    dtype_ = parameter.scalar_type();
    const int64_t world = cluster_.world_size, rank = cluster_.global_rank;
    ShardedParameter p;
    p.full = parameter;
    p.trainable = parameter.requires_grad();
    p.rows = parameter.dim() == 0 ? 1 : parameter.size(0);
    p.row_numel = p.rows == 0 ? 0 : parameter.numel() / p.rows;
    p.chunk_rows = (p.rows + world - 1) / world;
    p.begin = std::min(p.rows, rank * p.chunk_rows);
    p.end = std::min(p.rows, (rank + 1) * p.chunk_rows);
    if (zero_stage_ == 3) {
      // A tensor of its own: the parameter's storage is freed between uses.
      const c10::Storage& storage = parameter.storage();
      if (!parameter.is_contiguous() || parameter.storage_offset() != 0 ||
          storage.nbytes() != static_cast<size_t>(parameter.numel()) * parameter.element_size())
        throw Error(ErrorKind::config,
                    "strategy 'fsdp': zero_stage = 3 frees each parameter's storage between uses, and a parameter "
                    "shares its storage with other tensors (a view, tied weights, a slice of a larger tensor); "
                    "give each parameter its own contiguous tensor or use zero_stage = 2");
      torch::NoGradGuard no_grad;
      p.full_alias = at::empty({0}, parameter.options()).set_(storage, 0, parameter.sizes(), parameter.strides());
      p.full_nbytes = storage.nbytes();
      p.shard = p.rows_of(p.full_alias, p.begin, p.local_rows()).clone().reshape(p.shard_shape());
      return shards_.emplace(parameter.unsafeGetTensorImpl(), std::move(p)).first->second;
    }
    // A view, not a copy: the optimizer updates this rank's rows of the parameter in place, and the
    // model holds no second copy of them (DeepSpeed's accounting: no extra 4 bytes per parameter).
    p.shard = p.rows_of(parameter.detach(), p.begin, p.local_rows()).reshape(p.shard_shape());
    if (p.local_rows() > 0 && !p.shard.is_alias_of(parameter))
      throw Error(ErrorKind::config,
                  "strategy 'fsdp': a parameter that is not contiguous cannot be sharded in place; "
                  "make it contiguous in the Module's constructor");
    return shards_.emplace(parameter.unsafeGetTensorImpl(), std::move(p)).first->second;
  }

  const std::vector<ShardedParameter*>& shards_for(torch::optim::Optimizer& optimizer) const {
    auto found = optimizer_shards_.find(&optimizer);
    if (found == optimizer_shards_.end())
      throw Error(ErrorKind::runtime, "strategy 'fsdp': an optimizer that setup_optimizers never saw");
    return found->second;
  }

  // Each parameter's padded chunk gets its place in one rank's slice of the flat buffers.
  void layout_flat_buffers() {
    flat_numel_ = 0;
    for (ShardedParameter* p : ordered_) {
      p->flat_offset = flat_numel_;
      flat_numel_ += p->chunk_numel();
    }
  }

  at::TensorOptions flat_options() const { return at::TensorOptions().dtype(dtype_).device(device_); }
  // Gradients travel in the reduce dtype (bfloat16 halves the bytes) and land on the shards in the
  // parameters' dtype.
  at::TensorOptions reduce_options() const {
    return at::TensorOptions().dtype(reduce_dtype_.value_or(param_dtype_.value_or(dtype_))).device(device_);
  }

  // Averages the gradients of a step across ranks and leaves each rank its rows of them, on the
  // shards; the full gradients are dropped (stage 2 never holds the averaged full gradient).
  void reduce_gradients() {
    torch::NoGradGuard no_grad;
    const int64_t world = cluster_.world_size, n = static_cast<int64_t>(ordered_.size());
    // A parameter that got no gradient on any rank keeps none, as in one process.
    at::Tensor has_gradient = at::zeros({std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(at::kInt));
    auto flags = has_gradient.accessor<int, 1>();
    for (int64_t i = 0; i < n; ++i) flags[i] = ordered_[i]->full.grad().defined() ? 1 : 0;
    if (communicator_ && n > 0) communicator_->all_reduce(has_gradient, fulgur::ReduceOp::max);
    const auto used = has_gradient.accessor<int, 1>();

    at::Tensor mine;  // this rank's averaged rows, in flat layout
    if (zero_stage_ == 1) {
      // All-reduce the whole gradient in one flat buffer, then keep this rank's rows.
      at::Tensor flat = at::zeros({world * flat_numel_}, reduce_options());
      for (int64_t i = 0; i < n; ++i) copy_rows_rank_major(*ordered_[i], used[i], flat);
      if (communicator_) communicator_->all_reduce(flat, fulgur::ReduceOp::mean);
      mine = flat.narrow(0, cluster_.global_rank * flat_numel_, flat_numel_);
    } else {
      // Reduce-scatter: every rank sends its gradient cut into per-rank chunks, receives its own.
      at::Tensor flat = at::zeros({world * flat_numel_}, reduce_options());
      for (int64_t i = 0; i < n; ++i) copy_rows_rank_major(*ordered_[i], used[i], flat);
      mine = at::zeros({flat_numel_}, reduce_options());
      if (communicator_)
        communicator_->reduce_scatter(mine, flat, fulgur::ReduceOp::mean);
      else
        mine.copy_(flat);
    }
    if (offload_optimizer_) mine = mine.to(at::kCPU);  // one copy to host memory for every parameter
    for (int64_t i = 0; i < n; ++i) {
      ShardedParameter& p = *ordered_[i];
      p.full.mutable_grad().reset();
      if (used[i]) land_gradient(p, mine.narrow(0, p.flat_offset, p.local_rows() * p.row_numel));
    }
  }

  // This rank's averaged rows of a gradient onto what the optimizer steps. A gradient not zeroed
  // since the last step (manual optimization) accumulates, as in one process.
  static void land_gradient(ShardedParameter& p, const at::Tensor& flat_rows) {
    const at::Tensor rows = flat_rows.reshape(p.shard_shape());
    at::Tensor& target = p.stepped();
    at::Tensor& grad = target.mutable_grad();
    if (grad.defined())
      grad.add_(rows);
    else
      grad = rows.to(target.options(), /*non_blocking=*/false, /*copy=*/true);
  }

  // Chunk j of the parameter's gradient (zeros when it has none) into rank j's slice of `flat`.
  void copy_rows_rank_major(const ShardedParameter& p, bool used, at::Tensor& flat) const {
    if (!used || !p.full.grad().defined()) return;  // zeros already
    const at::Tensor grad = p.full.grad();
    for (int64_t j = 0; j < cluster_.world_size; ++j) {
      const int64_t first = std::min(p.rows, j * p.chunk_rows);
      const int64_t count = std::min(p.rows, (j + 1) * p.chunk_rows) - first;
      if (count <= 0) continue;
      flat.narrow(0, j * flat_numel_ + p.flat_offset, count * p.row_numel)
          .view({count, p.row_numel})
          .copy_(p.rows_of(grad, first, count));
    }
  }

  // A loss scaler skips a step with inf/NaN gradients; with sharded gradients only some ranks
  // see them, so the decision is taken together: a rank without any marks one of its own.
  void agree_on_non_finite_gradients(torch::optim::Optimizer& optimizer) {
    if (!communicator_) return;
    bool local = false;
    at::Tensor* mark = nullptr;
    for (ShardedParameter* p : shards_for(optimizer)) {
      at::Tensor& grad = p->stepped().mutable_grad();
      if (!grad.defined() || grad.numel() == 0) continue;
      if (!mark) mark = &grad;
      if (!grad.isfinite().all().item<bool>()) local = true;
    }
    if (!reduce_boolean_decision(local, /*all=*/false) || local || !mark) return;
    mark->view(-1)[0] = std::numeric_limits<double>::quiet_NaN();
  }

  // After the step: every rank's updated rows, gathered into the full parameters (one collective).
  void gather_parameters(torch::optim::Optimizer& optimizer) {
    (void)optimizer;  // all sharded parameters: the flat buffer spans every optimizer's
    torch::NoGradGuard no_grad;
    at::Tensor mine = at::zeros({flat_numel_}, flat_options());
    for (ShardedParameter* p : ordered_)
      mine.narrow(0, p->flat_offset, p->local_rows() * p->row_numel).copy_(p->shard.reshape({-1}));
    at::Tensor all = mine;
    if (communicator_) {
      all = at::empty({cluster_.world_size * flat_numel_}, flat_options());
      communicator_->all_gather_into_tensor(all, mine);
    }
    for (ShardedParameter* p : ordered_)
      for (int64_t j = 0; j < cluster_.world_size; ++j) {
        const int64_t first = std::min(p->rows, j * p->chunk_rows);
        const int64_t count = std::min(p->rows, (j + 1) * p->chunk_rows) - first;
        if (count <= 0) continue;
        p->rows_of(p->full, first, count)
            .copy_(all.narrow(0, j * flat_numel_ + p->flat_offset, count * p->row_numel).view({count, p->row_numel}));
      }
  }

  // A tensor shaped like this rank's rows of `p`, gathered into the parameter's full shape.
  at::Tensor gather_rows(const ShardedParameter& p, const at::Tensor& local) {
    // On the device: with offload_optimizer the optimizer state is in host memory, which NCCL cannot send.
    at::Tensor padded = at::zeros({p.chunk_numel()}, local.options().device(device_));
    padded.narrow(0, 0, local.numel()).copy_(local.reshape({-1}));
    at::Tensor all = padded;
    if (communicator_) {
      all = at::empty({cluster_.world_size * p.chunk_numel()}, padded.options());
      communicator_->all_gather_into_tensor(all, padded);
    }
    std::vector<at::Tensor> pieces;
    for (int64_t j = 0; j < cluster_.world_size; ++j) {
      const int64_t count = std::min(p.rows, (j + 1) * p.chunk_rows) - std::min(p.rows, j * p.chunk_rows);
      if (count > 0) pieces.push_back(all.narrow(0, j * p.chunk_numel(), count * p.row_numel));
    }
    return at::cat(pieces).reshape(p.full.sizes());
  }

  // `state` in torch.optim's layout with every per-parameter tensor (not "step") passed through `fn`
  // (gathered or sliced); a new dict, the input is left alone. Keys are visited in the same order on
  // every rank, so the collectives inside `fn` pair up.
  template <class Fn>
  static c10::IValue map_parameter_states(const c10::IValue& state, const std::vector<ShardedParameter*>& order,
                                          Fn&& fn) {
    if (!state.isGenericDict()) return state;
    const auto whole = state.toGenericDict();
    auto out = c10::impl::GenericDict(whole.keyType(), whole.valueType());
    for (const auto& entry : whole) {
      if (!(entry.key().isString() && entry.key().toStringRef() == "state") || !entry.value().isGenericDict()) {
        out.insert(entry.key(), entry.value());
        continue;
      }
      const auto per_parameter = entry.value().toGenericDict();
      auto mapped = c10::impl::GenericDict(per_parameter.keyType(), per_parameter.valueType());
      for (const auto& item : per_parameter) {
        const int64_t index = item.key().isInt() ? item.key().toInt() : -1;
        if (index < 0 || index >= static_cast<int64_t>(order.size()) || !item.value().isGenericDict()) {
          mapped.insert(item.key(), item.value());
          continue;
        }
        const auto tensors = item.value().toGenericDict();
        auto converted = c10::impl::GenericDict(tensors.keyType(), tensors.valueType());
        for (const auto& t : tensors) {
          const bool per_element = t.value().isTensor() && !(t.key().isString() && t.key().toStringRef() == "step");
          converted.insert(t.key(), per_element ? c10::IValue(fn(*order[index], t.value().toTensor())) : t.value());
        }
        mapped.insert(item.key(), converted);
      }
      out.insert(entry.key(), mapped);
    }
    return out;
  }

  // Whether a model state holds this rank's rows of the split parameters rather than whole tensors.
  bool holds_rows(const c10::IValue& state) const {
    if (!state.isGenericDict()) return false;
    const auto dict = state.toGenericDict();
    for (const auto& [name, p] : named_) {
      auto found = dict.find(name);
      if (found != dict.end() && found->value().isTensor() && p->is_local_rows(found->value().toTensor())) return true;
    }
    return false;
  }

  // Rows into the shards (whole tensors are cut, as above), buffers as usual; the same checks of
  // missing, unexpected and mis-shaped keys as fulgur::load_module_state_dict.
  void load_module_rows(torch::nn::Module& module, const c10::IValue& state, bool strict, const std::string& origin) {
    const auto dict = state.toGenericDict();
    auto buffers = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
    std::vector<std::string> missing, unexpected, mismatched;
    std::set<std::string> known;
    for (const auto& item : module.named_buffers()) known.insert(item.key());
    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : named_) {
      known.insert(name);
      auto found = dict.find(name);
      if (found == dict.end() || !found->value().isTensor()) {
        missing.push_back(name);
        continue;
      }
      const at::Tensor t = found->value().toTensor();
      if (p->is_local_rows(t))
        p->shard.copy_(t);
      else if (t.sizes() == p->full.sizes())
        p->shard.copy_(p->rows_of(t.to(p->shard.device()), p->begin, p->local_rows()).reshape(p->shard_shape()));
      else
        mismatched.push_back(fmt::format("{} (checkpoint {}, model {} of which rank {} holds rows {}..{})", name,
                                         c10::str(t.sizes()), c10::str(p->full.sizes()), cluster_.global_rank, p->begin,
                                         p->end));
    }
    for (const auto& entry : dict) {
      const std::string name = entry.key().isString() ? entry.key().toStringRef() : std::string();
      if (!known.contains(name))
        unexpected.push_back(name);
      else if (!named_.contains(name))
        buffers.insert(entry.key(), entry.value());
    }
    if (!strict) missing.clear(), unexpected.clear();
    if (!missing.empty() || !unexpected.empty() || !mismatched.empty())
      throw Error(
          ErrorKind::checkpoint,
          fmt::format("checkpoint {}: the model state does not fit the model: missing [{}], unexpected [{}], "
                      "mis-shaped [{}]",
                      origin, fmt::join(missing, ", "), fmt::join(unexpected, ", "), fmt::join(mismatched, ", ")));
    fulgur::load_module_state_dict(module, buffers, /*strict=*/false, origin);
    // Whole copies held now are stale: refresh them from the new shards (the others gather later).
    std::vector<ShardedParameter*> whole;
    for (ShardedParameter* p : ordered_)
      if (p->materialised) whole.push_back(p);
    gather_group(whole, /*refresh=*/true);
  }

  // ---- sharded checkpoints ---------------------------------------------------------------------

  static std::optional<at::ScalarType> parse_dtype(const char* option, const std::string& value) {
    if (value == "auto") return std::nullopt;
    if (value == "float32") return at::kFloat;
    if (value == "bfloat16") return at::kBFloat16;
    if (value == "float16") return at::kHalf;
    if (value == "float64") return at::kDouble;
    throw Error(ErrorKind::config,
                fmt::format("strategy 'fsdp': {} = \"{}\" is not known; use \"auto\", \"float32\", \"bfloat16\", "
                            "\"float16\" or \"float64\"",
                            option, value));
  }

  static bool parse_state_dict_type(const std::string& value) {
    if (value == "full") return false;
    if (value == "sharded") return true;
    throw Error(ErrorKind::config,
                fmt::format("strategy 'fsdp': state_dict_type = \"{}\" is not known; use \"full\" (one file, "
                            "gathered on rank 0) or \"sharded\" (a directory, every rank writing its rows)",
                            value));
  }

  // Where this rank's rows of `p` sit in the whole tensor; nullopt when it holds none of them or
  // the tensor is not split (a 0-dim parameter: rank 0 writes it, as a replicated tensor).
  static std::optional<fulgur::dcp::Chunk> chunk_of(const ShardedParameter& p) {
    if (p.full.dim() == 0) return std::nullopt;
    std::vector<int64_t> offsets(p.full.dim(), 0);
    offsets[0] = p.begin;
    return fulgur::dcp::Chunk().set_global_shape(p.full.sizes().vec()).set_offsets(std::move(offsets));
  }

  // The parameters as this rank holds them: its rows (no copy, no collective); buffers whole.
  c10::IValue sharded_module_state(torch::nn::Module& module) {
    placements_.clear();
    auto state = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : module.named_parameters()) {
      auto found = shards_.find(item.value().unsafeGetTensorImpl());
      if (found == shards_.end()) {  // not split (no optimizer set up yet): whole, like a buffer
        state.insert(item.key(), item.value().detach());
        continue;
      }
      const ShardedParameter& p = found->second;
      if (p.local_rows() == 0) continue;  // nothing of it here
      state.insert(item.key(), p.shard.detach());
      if (auto chunk = chunk_of(p)) placements_["state_dict." + item.key()] = *chunk;
    }
    for (const auto& item : module.named_buffers()) state.insert(item.key(), item.value().detach());
    return state;
  }

  // torch.optim's layout with this rank's rows of each per-element state (Adam's moments);
  // "step" and the param groups are the same on every rank (written once).
  c10::IValue sharded_optimizer_state(torch::optim::Optimizer& optimizer, const c10::IValue& local,
                                      const std::vector<ShardedParameter*>& order) {
    const auto position = std::find(optimizer_order_.begin(), optimizer_order_.end(), &optimizer);
    const int64_t index = position - optimizer_order_.begin();
    if (!local.isGenericDict()) return local;
    const auto whole = local.toGenericDict();
    auto out = c10::impl::GenericDict(whole.keyType(), whole.valueType());
    for (const auto& entry : whole) {
      if (!(entry.key().isString() && entry.key().toStringRef() == "state") || !entry.value().isGenericDict()) {
        out.insert(entry.key(), entry.value());
        continue;
      }
      const auto per_parameter = entry.value().toGenericDict();
      auto kept = c10::impl::GenericDict(per_parameter.keyType(), per_parameter.valueType());
      for (const auto& item : per_parameter) {
        const int64_t i = item.key().isInt() ? item.key().toInt() : -1;
        if (i < 0 || i >= static_cast<int64_t>(order.size()) || !item.value().isGenericDict()) {
          kept.insert(item.key(), item.value());
          continue;
        }
        const ShardedParameter& p = *order[i];
        const auto chunk = chunk_of(p);
        auto tensors =
            c10::impl::GenericDict(item.value().toGenericDict().keyType(), item.value().toGenericDict().valueType());
        for (const auto& t : item.value().toGenericDict()) {
          const std::string name = t.key().isString() ? t.key().toStringRef() : std::string();
          const bool per_element = t.value().isTensor() && name != "step";
          if (per_element && p.local_rows() == 0) continue;  // nothing of it here
          tensors.insert(t.key(), t.value());
          if (per_element && chunk)
            placements_[fmt::format("optimizer_states.{}.state.{}.{}", index, i, name)] = *chunk;
        }
        kept.insert(item.key(), tensors);
      }
      out.insert(entry.key(), kept);
    }
    return out;
  }

  // ---- stage 3 ---------------------------------------------------------------------------------

  struct InFlightGather;
  struct Unit {
    std::vector<ShardedParameter*> parameters;  // those no other block claimed first
    c10::intrusive_ptr<AfterBlock> after;
    int64_t order = -1;                          // its place in the previous training forward
    std::unique_ptr<InFlightGather> prefetched;  // an all-gather started ahead of its use
  };

  Unit& unit_of(torch::nn::Module& block) {
    auto found = units_.find(&block);
    if (found != units_.end()) return found->second;
    Unit unit;
    for (const at::Tensor& parameter : block.parameters()) {
      auto sharded = shards_.find(parameter.unsafeGetTensorImpl());
      if (sharded == shards_.end() || sharded->second.in_block) continue;
      sharded->second.in_block = true;
      if (param_dtype_ && full_parameters_held_ == 0) set_storage_dtype(sharded->second, *param_dtype_);
      unit.parameters.push_back(&sharded->second);
    }
    if (param_dtype_ && !unit.parameters.empty() && fulgur::log::enabled(fulgur::log::Level::debug))
      fulgur::log::debug(fmt::format("strategy 'fsdp': a block of {} parameters computes in {}", unit.parameters.size(),
                                     c10::toString(unit.parameters.front()->full.scalar_type())));
    return units_.emplace(&block, std::move(unit)).first->second;
  }

  // The order blocks ran in during the last training forward: what prefetching follows, in this
  // step's backward and the next step's forward (the same on every rank, so the prefetches pair up).
  void remember_forward_order() {
    if (this_forward_.empty()) return;
    forward_order_ = std::move(this_forward_);
    this_forward_.clear();
    for (auto& [module, unit] : units_) unit.order = -1;
    for (size_t i = 0; i < forward_order_.size(); ++i)
      if (forward_order_[i]->order < 0) forward_order_[i]->order = static_cast<int64_t>(i);
  }

  c10::intrusive_ptr<AfterBlock> unit_capsule(Unit& unit) {
    if (!unit.after) {
      unit.after = c10::make_intrusive<AfterBlock>();
      unit.after->run = [this, &unit] { after_block_backward(unit); };
    }
    return unit.after;
  }

  void after_block_backward(Unit& unit) {
    if (sync_gradients_) reduce_scatter_group(unit.parameters);
    if (full_parameters_held_ == 0)
      for (ShardedParameter* p : unit.parameters) release(*p);
  }

  // The end of backward: whatever no block hook reduced (the first block, parameters outside
  // blocks) in one reduce-scatter; blocks' parameters freed. Micro-steps keep whole gradients.
  void finish_backward() {
    drain_prefetches();
    if (sync_gradients_) {
      std::vector<ShardedParameter*> rest;
      for (ShardedParameter* p : ordered_)
        if (!p->reduced) rest.push_back(p);
      reduce_scatter_group(rest);
    }
    if (full_parameters_held_ == 0)
      for (ShardedParameter* p : ordered_)
        if (p->in_block) release(*p);
  }

  // Frees a parameter's storage; its shape, autograd identity and gradient stay.
  static void release(ShardedParameter& p) {
    if (!p.materialised || p.full_nbytes == 0) return;
    c10::StorageImpl* storage = p.full.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, p.full.device()));
    storage->set_nbytes(0);
    p.materialised = false;
  }

  static void allocate(ShardedParameter& p) {
    if (p.materialised) return;
    c10::StorageImpl* storage = p.full.storage().unsafeGetStorageImpl();
    c10::Allocator* allocator = storage->allocator();
    if (!allocator) allocator = c10::GetAllocator(p.full.device().type());
    storage->set_data_ptr_noswap(allocator->allocate(p.full_nbytes));
    storage->set_nbytes(p.full_nbytes);
    p.materialised = true;
  }

  // Gives a stage-3 parameter freed storage of another dtype (its values come from the shards at
  // the next gather). The Module keeps the same parameter: set_data changes what it holds, not its
  // identity. Only between steps or on a block's first use, before autograd saw the parameter.
  static void set_storage_dtype(ShardedParameter& p, at::ScalarType dtype) {
    if (p.full.scalar_type() == dtype) return;
    torch::NoGradGuard no_grad;
    const at::Tensor grad = p.full.grad();
    p.full.set_data(at::empty(p.full.sizes(), p.full.options().dtype(dtype)));
    if (grad.defined()) p.full.mutable_grad() = grad.to(dtype);
    const c10::Storage& storage = p.full.storage();
    p.full_alias = at::empty({0}, p.full.options()).set_(storage, 0, p.full.sizes(), p.full.strides());
    p.full_nbytes = storage.nbytes();
    p.materialised = true;
    release(p);
  }

  // An all-gather under way: this rank's padded shards and the buffer every rank's arrive in.
  struct InFlightGather {
    at::Tensor mine, all;
    int64_t unit_numel = 0;
    std::unique_ptr<fulgur::PendingCollective> pending;  // null: already complete
  };

  // One all-gather makes the group's parameters whole from every rank's shards (each padded to
  // its chunk size). A group already whole on this rank is whole on every rank (the same hooks ran
  // everywhere), so it costs nothing, unless `refresh` (the shards were stepped).
  void gather_group(const std::vector<ShardedParameter*>& group, bool refresh = false, bool drain = true) {
    if (drain) drain_prefetches();  // a prefetched unit may overlap the group
    bool needed = refresh;
    for (ShardedParameter* p : group) needed = needed || !p->materialised;
    if (group.empty() || !needed) return;
    // One collective per dtype (under param_dtype, blocks' parameters and the others differ).
    std::vector<ShardedParameter*> same, other;
    for (ShardedParameter* p : group)
      (p->full.scalar_type() == group.front()->full.scalar_type() ? same : other).push_back(p);
    if (!other.empty()) {
      gather_group(same, /*refresh=*/true, /*drain=*/false);
      gather_group(other, /*refresh=*/true, /*drain=*/false);
      return;
    }
    InFlightGather gather = start_gather(group, /*async=*/false);
    finish_gather(group, gather);
  }

  InFlightGather start_gather(const std::vector<ShardedParameter*>& group, bool async) {
    torch::NoGradGuard no_grad;
    InFlightGather gather;
    for (ShardedParameter* p : group) gather.unit_numel += p->chunk_numel();
    // In the dtype the parameters compute in: the shards are cast on the way in (param_dtype).
    const at::TensorOptions options = flat_options().dtype(group.front()->full.scalar_type());
    gather.mine = at::zeros({gather.unit_numel}, options);
    int64_t offset = 0;
    for (ShardedParameter* p : group) {
      gather.mine.narrow(0, offset, p->local_rows() * p->row_numel).copy_(p->shard.reshape({-1}));
      offset += p->chunk_numel();
    }
    gather.all = gather.mine;
    if (communicator_) {
      gather.all = at::empty({cluster_.world_size * gather.unit_numel}, options);
      if (async)
        gather.pending = communicator_->all_gather_into_tensor_async(gather.all, gather.mine);
      else
        communicator_->all_gather_into_tensor(gather.all, gather.mine);
    }
    ++all_gathers_;
    return gather;
  }

  void finish_gather(const std::vector<ShardedParameter*>& group, InFlightGather& gather) {
    torch::NoGradGuard no_grad;
    if (gather.pending) gather.pending->wait();
    gather.pending.reset();
    const int64_t unit_numel = gather.unit_numel;
    int64_t offset = 0;
    for (ShardedParameter* p : group) {
      allocate(*p);
      for (int64_t j = 0; j < cluster_.world_size; ++j) {
        const int64_t first = std::min(p->rows, j * p->chunk_rows);
        const int64_t count = std::min(p->rows, (j + 1) * p->chunk_rows) - first;
        if (count <= 0) continue;
        p->rows_of(p->full_alias, first, count)
            .copy_(gather.all.narrow(0, j * unit_numel + offset, count * p->row_numel).view({count, p->row_numel}));
      }
      offset += p->chunk_numel();
    }
  }

  // A unit whole for its forward or backward: from its prefetch when one is under way.
  void gather_unit(Unit& unit) {
    if (unit.prefetched) {
      finish_gather(unit.parameters, *unit.prefetched);
      unit.prefetched.reset();
      return;
    }
    gather_group(unit.parameters, /*refresh=*/false, /*drain=*/false);  // units never overlap
  }

  // Starts the all-gather of the unit that ran `step` places away from `unit` in the previous
  // training forward (+1 in forward, -1 in backward), so that it overlaps this unit's compute.
  void prefetch_after(const Unit& unit, int step) {
    if (!prefetch_ || unit.order < 0) return;
    const int64_t next = unit.order + step;
    if (next < 0 || next >= static_cast<int64_t>(forward_order_.size())) return;
    Unit& target = *forward_order_[next];
    if (target.prefetched || prefetch_in_flight()) return;  // one ahead at most: two units whole, not more
    bool needed = false;
    for (ShardedParameter* p : target.parameters) needed = needed || !p->materialised;
    if (!needed) return;
    target.prefetched = std::make_unique<InFlightGather>(start_gather(target.parameters, /*async=*/true));
    ++prefetches_;
  }

  bool prefetch_in_flight() const {
    for (const auto& [module, unit] : units_)
      if (unit.prefetched) return true;
    return false;
  }

  void drain_prefetches() {
    for (auto& [module, unit] : units_) {
      (void)module;
      if (!unit.prefetched) continue;
      auto gather = std::move(unit.prefetched);
      finish_gather(unit.parameters, *gather);
    }
  }

  // Averages the group's gradients across ranks and leaves each rank its rows, on the shards, in
  // one reduce-scatter. Each rank's slice ends with one flag per parameter (1: it has a gradient
  // here), summed with the gradients: a parameter no rank gave a gradient keeps none, as in one
  // process, without a second collective.
  void reduce_scatter_group(const std::vector<ShardedParameter*>& candidates) {
    std::vector<ShardedParameter*> group;
    for (ShardedParameter* p : candidates)
      if (p->trainable && !p->reduced) group.push_back(p);
    if (group.empty()) return;
    torch::NoGradGuard no_grad;
    const int64_t world = cluster_.world_size, n = static_cast<int64_t>(group.size());
    int64_t slice = n;
    for (ShardedParameter* p : group) slice += p->chunk_numel();
    at::Tensor flat = at::zeros({world * slice}, reduce_options());
    int64_t offset = 0;
    for (ShardedParameter* p : group) {
      const at::Tensor grad = p->full.grad();
      if (grad.defined())
        for (int64_t j = 0; j < world; ++j) {
          const int64_t first = std::min(p->rows, j * p->chunk_rows);
          const int64_t count = std::min(p->rows, (j + 1) * p->chunk_rows) - first;
          if (count > 0)
            flat.narrow(0, j * slice + offset, count * p->row_numel)
                .view({count, p->row_numel})
                .copy_(p->rows_of(grad, first, count));
        }
      offset += p->chunk_numel();
    }
    for (int64_t j = 0; j < world; ++j)
      for (int64_t i = 0; i < n; ++i)
        if (group[i]->full.grad().defined()) flat[j * slice + offset + i] = 1;
    at::Tensor mine = at::zeros({slice}, reduce_options());
    if (communicator_)
      communicator_->reduce_scatter(mine, flat, fulgur::ReduceOp::sum);
    else
      mine.copy_(flat);
    ++reduce_scatters_;
    mine.narrow(0, 0, offset).div_(static_cast<double>(world));
    const at::Tensor landed = offload_optimizer_ ? mine.to(at::kCPU) : mine;  // one copy to host memory
    const auto flags = landed.narrow(0, offset, n).to(at::kCPU);
    offset = 0;
    for (int64_t i = 0; i < n; ++i) {
      ShardedParameter& p = *group[i];
      p.reduced = true;
      p.full.mutable_grad().reset();
      if (flags[i].item<double>() > 0) land_gradient(p, landed.narrow(0, offset, p.local_rows() * p.row_numel));
      offset += p.chunk_numel();
    }
  }

  int64_t zero_stage_;
  bool reshard_after_forward_;
  bool sync_gradients_ = true;
  int full_parameters_held_ = 0;  // FullParameters guards alive (nested ones count)
  int64_t all_gathers_ = 0, reduce_scatters_ = 0, prefetches_ = 0;
  bool prefetch_;
  std::map<const torch::nn::Module*, Unit> units_;
  std::vector<Unit*> forward_order_, this_forward_;
  bool sharded_checkpoints_;
  bool offload_optimizer_;
  std::optional<at::ScalarType> reduce_dtype_;            // nullopt: param_dtype_, else the parameters' dtype
  std::optional<at::ScalarType> param_dtype_;             // stage 3: blocks compute in it (nullopt: the model's)
  std::map<std::string, fulgur::dcp::Chunk> placements_;  // of the state dicts made for the next save
  std::map<std::string, ShardedParameter*> named_;        // stage 3: every parameter by its dotted name
  std::vector<const torch::optim::Optimizer*> optimizer_order_;
  at::ScalarType dtype_ = at::kFloat;
  std::map<const c10::TensorImpl*, ShardedParameter> shards_;
  std::map<const torch::optim::Optimizer*, std::vector<ShardedParameter*>> optimizer_shards_;
  std::vector<ShardedParameter*> ordered_;
  int64_t flat_numel_ = 0;
  // Stage 3, while configure_model runs: how the Trainer prepares a block (device, precision).
  const fulgur::ModelBuild* building_ = nullptr;
  int64_t built_blocks_ = 0, built_bytes_ = 0, largest_built_bytes_ = 0;
};

}  // namespace

FULGUR_PLUGIN(
    FsdpStrategy, "fsdp", "0.2.0",
    "Sharded data parallel (ZeRO-1/2/3): optimizer state, with stage 2 gradients, with stage 3 parameters split "
    "across ranks (stage 3 gathers each fulgur::run_block block's parameters around its forward and backward); "
    "checkpoints hold the full state and load under any world size",
    FULGUR_OPTION(integer, zero_stage,
                  "1: shard optimizer state (gradients all-reduced); 2: also shard gradients (reduce-scattered); 3: "
                  "also shard parameters (whole only inside the blocks that use them)",
                  2),
    FULGUR_OPTION(boolean, reshard_after_forward,
                  "zero_stage = 3: free a block's gathered parameters after its forward and gather them again for its "
                  "backward (false: keep them until the block's backward is done: one all-gather fewer per block, "
                  "more memory)",
                  true),
    FULGUR_OPTION(boolean, prefetch,
                  "zero_stage = 3: start the all-gather of the next block (in the order of the previous training "
                  "forward; backward: the previous block) before the current one computes, so that they overlap",
                  true),
    FULGUR_OPTION(string, reduce_dtype,
                  "dtype the gradients are averaged in across ranks: \"auto\" (param_dtype's, else the parameters'), "
                  "\"float32\", "
                  "\"bfloat16\" (half the bytes on the wire), \"float16\", \"float64\"; the shards' gradients are in "
                  "the parameters' dtype",
                  "auto"),
    FULGUR_OPTION(string, param_dtype,
                  "zero_stage = 3: dtype the blocks' parameters are gathered and computed in (FSDP2's param_dtype): "
                  "\"auto\" (the model's), \"bfloat16\" (half the bytes gathered and held), \"float16\", "
                  "\"float32\", \"float64\"; a block's inputs are cast to it and its output back; the shards, "
                  "optimizer state, checkpoints and fulgur::FullParameters stay in the model's dtype; gradients are "
                  "then averaged in it unless reduce_dtype says otherwise",
                  "auto"),
    FULGUR_OPTION(
        string, state_dict_type,
        "\"full\": checkpoints are one file of whole tensors, gathered on rank 0; \"sharded\": a directory in "
        "torch.distributed.checkpoint's format, each rank writing its own rows (no gathering); both resume "
        "under any world size and strategy",
        "full"),
    FULGUR_OPTION(boolean, offload_optimizer,
                  "ZeRO-Offload: the optimizer steps a copy of this rank's rows in host memory (pinned), so its state "
                  "(Adam: 8 bytes per parameter) stays off the device; gradients travel to host memory after each "
                  "reduction and the updated rows back after each step; for accelerator = \"cuda\" (on cpu it only "
                  "adds copies, with a warning)",
                  false),
    FULGUR_OPTION(string, backend, "Process group backend: \"auto\" (the accelerator's), \"gloo\", \"nccl\"", "auto"),
    FULGUR_OPTION(floating, timeout,
                  "Seconds a collective or the rendezvous may wait for the other ranks before failing", 1800.0))
