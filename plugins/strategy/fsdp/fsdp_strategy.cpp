// Built-in strategy `fsdp`: sharded data parallel, ZeRO stages 1 and 2, one process per device.
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
//   (* fp32 parameters and Adam, Ψ parameters, N ranks; DeepSpeed's accounting)
//
// After the step, one all-gather of the updated rows refreshes the full parameters, which every
// rank keeps for forward and backward (stage 3, sharded parameters, is not built yet). Clipping by
// norm uses the global norm across shards, and a skipped step (inf/NaN gradients under a loss
// scaler) is skipped on every rank together. Checkpoints hold the full, unsharded model and
// optimizer state in torch.optim's layout, gathered on rank zero: they load under any world size
// and any strategy.
#include <fulgur/communicator.h>
#include <fulgur/plugin.h>
#include <fulgur/state_dict.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <limits>
#include <map>
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
  int64_t rows = 1, chunk_rows = 1, row_numel = 1;
  int64_t begin = 0, end = 0;  // this rank's rows [begin, end)
  int64_t flat_offset = 0;     // its padded chunk's place in one rank's slice of the flat buffers
  bool trainable = true;       // frozen parameters (requires_grad false) never get gradients

  int64_t local_rows() const { return end - begin; }
  int64_t chunk_numel() const { return chunk_rows * row_numel; }
  // Rows [first, first + count) of a tensor shaped like the parameter, as [count, row_numel].
  at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t count) const {
    return t.reshape({rows, row_numel}).narrow(0, first, count);
  }
  // The shape of this rank's rows (a 0-dim parameter: 0-dim on its owner, {0} elsewhere).
  std::vector<int64_t> shard_shape() const {
    if (full.dim() == 0) return local_rows() == 1 ? std::vector<int64_t>{} : std::vector<int64_t>{0};
    std::vector<int64_t> shape(full.sizes().begin(), full.sizes().end());
    shape[0] = local_rows();
    return shape;
  }
};

class FsdpStrategy final : public fulgur::strategy_support::ProcessGroupStrategy {
 public:
  explicit FsdpStrategy(const fulgur::Options& options)
      : ProcessGroupStrategy("fsdp", options), zero_stage_(options.get_int("zero_stage")) {
    if (zero_stage_ == 3)
      throw Error(ErrorKind::config,
                  "strategy 'fsdp': zero_stage = 3 (sharded parameters) is not available yet; use "
                  "1 (sharded optimizer state) or 2 (sharded optimizer state and gradients)");
    if (zero_stage_ != 1 && zero_stage_ != 2)
      throw Error(ErrorKind::config,
                  fmt::format("strategy 'fsdp': zero_stage = {} is not a ZeRO stage; use 1 or 2", zero_stage_));
  }

  void setup_module(torch::nn::Module& module) override {
    shards_.clear();
    optimizer_shards_.clear();
    module.to(device_);
    if (!communicator_) return;
    // Every rank starts from rank 0's weights and buffers, as under ddp.
    std::vector<at::Tensor> state;
    for (auto& p : module.parameters()) state.push_back(p);
    for (auto& b : module.buffers()) state.push_back(b);
    communicator_->broadcast_coalesced(state, 0);
  }

  // The optimizers step this rank's rows: each parameter in their groups is swapped for its shard.
  void setup_optimizers(std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers) override {
    shards_.clear();
    optimizer_shards_.clear();
    ordered_.clear();
    for (auto& optimizer : optimizers) {
      check_supported(*optimizer);
      std::vector<ShardedParameter*>& order = optimizer_shards_[optimizer.get()];
      for (auto& group : optimizer->param_groups())
        for (at::Tensor& parameter : group.params()) {
          const bool new_one = !shards_.contains(parameter.unsafeGetTensorImpl());
          ShardedParameter& sharded = shard_of(parameter);
          // The collectives' layout follows the optimizers' param groups: the same order on every rank.
          if (new_one) ordered_.push_back(&sharded);
          order.push_back(&sharded);
          parameter = sharded.shard;
        }
    }
    layout_flat_buffers();
  }

  void backward(const at::Tensor& loss, fulgur::Precision& precision, bool sync_gradients) override {
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
      if (p->shard.grad().defined() && p->shard.numel() > 0)
        sum_of_squares += p->shard.grad().detach().to(at::kDouble).pow(2).sum();
    if (communicator_) communicator_->all_reduce(sum_of_squares, fulgur::ReduceOp::sum);
    const double total_norm = std::sqrt(sum_of_squares.item<double>());
    const double coefficient = std::min(1.0, clip_value / (total_norm + 1e-6));
    for (ShardedParameter* p : shards_for(optimizer))
      if (p->shard.grad().defined()) p->shard.mutable_grad().mul_(coefficient);
  }

  bool optimizer_step(torch::optim::Optimizer& optimizer, fulgur::Precision& precision) override {
    check_groups_unchanged(optimizer);
    agree_on_non_finite_gradients(optimizer);
    const bool stepped = precision.optimizer_step(optimizer);
    if (stepped) gather_parameters(optimizer);
    return stepped;
  }

  // ---- state: full tensors, gathered, in torch.optim's layout --------------------------------

  void load_module_state_dict(torch::nn::Module& module, const c10::IValue& state, bool strict,
                              const std::string& origin) override {
    // The shards are views of the parameters, which load in place: they follow the new weights.
    fulgur::load_module_state_dict(module, state, strict, origin);
  }

  c10::IValue optimizer_state_dict(torch::optim::Optimizer& optimizer) override {
    c10::IValue local = fulgur::optimizer_state_dict(optimizer);
    const std::vector<ShardedParameter*>& order = shards_for(optimizer);
    return map_parameter_states(local, order,
                                [&](const ShardedParameter& p, const at::Tensor& t) { return gather_rows(p, t); });
  }

  void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const c10::IValue& state,
                                 const std::string& origin) override {
    const std::vector<ShardedParameter*>& order = shards_for(optimizer);
    c10::IValue local = map_parameter_states(state, order, [&](const ShardedParameter& p, const at::Tensor& t) {
      if (t.numel() != p.full.numel())
        throw Error(ErrorKind::checkpoint,
                    fmt::format("{}: an optimizer state tensor of {} elements for a parameter of {} (shape {}); the "
                                "checkpoint belongs to another model",
                                origin, t.numel(), p.full.numel(), fmt::join(p.full.sizes(), "x")));
      return p.rows_of(t.to(p.shard.device()), p.begin, p.local_rows()).clone().reshape(p.shard_shape());
    });
    fulgur::load_optimizer_state_dict(optimizer, local, origin);
  }

 private:
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
      at::Tensor flat = at::zeros({world * flat_numel_}, flat_options());
      for (int64_t i = 0; i < n; ++i) copy_rows_rank_major(*ordered_[i], used[i], flat);
      if (communicator_) communicator_->all_reduce(flat, fulgur::ReduceOp::mean);
      mine = flat.narrow(0, cluster_.global_rank * flat_numel_, flat_numel_);
    } else {
      // Reduce-scatter: every rank sends its gradient cut into per-rank chunks, receives its own.
      at::Tensor flat = at::zeros({world * flat_numel_}, flat_options());
      for (int64_t i = 0; i < n; ++i) copy_rows_rank_major(*ordered_[i], used[i], flat);
      mine = at::zeros({flat_numel_}, flat_options());
      if (communicator_)
        communicator_->reduce_scatter(mine, flat, fulgur::ReduceOp::mean);
      else
        mine.copy_(flat);
    }
    for (int64_t i = 0; i < n; ++i) {
      ShardedParameter& p = *ordered_[i];
      p.full.mutable_grad().reset();
      if (!used[i]) continue;
      at::Tensor rows = mine.narrow(0, p.flat_offset, p.local_rows() * p.row_numel).reshape(p.shard_shape());
      at::Tensor& grad = p.shard.mutable_grad();
      if (grad.defined())
        grad.add_(rows);  // not zeroed since the last step (manual optimization): accumulate, as in one process
      else
        grad = rows.clone();
    }
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
      at::Tensor& grad = p->shard.mutable_grad();
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
    at::Tensor padded = at::zeros({p.chunk_numel()}, local.options());
    padded.narrow(0, 0, local.numel()).copy_(local.reshape({-1}));
    at::Tensor all = padded;
    if (communicator_) {
      all = at::empty({cluster_.world_size * p.chunk_numel()}, local.options());
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

  int64_t zero_stage_;
  at::ScalarType dtype_ = at::kFloat;
  std::map<const c10::TensorImpl*, ShardedParameter> shards_;
  std::map<const torch::optim::Optimizer*, std::vector<ShardedParameter*>> optimizer_shards_;
  std::vector<ShardedParameter*> ordered_;
  int64_t flat_numel_ = 0;
};

}  // namespace

FULGUR_PLUGIN(
    FsdpStrategy, "fsdp", "0.1.0",
    "Sharded data parallel (ZeRO-1/2): optimizer state, and with stage 2 gradients, split across ranks; "
    "checkpoints hold the full state and load under any world size",
    FULGUR_OPTION(integer, zero_stage,
                  "1: shard optimizer state (gradients all-reduced); 2: also shard gradients (reduce-scattered)", 2),
    FULGUR_OPTION(string, backend, "Process group backend: \"auto\" (the accelerator's), \"gloo\", \"nccl\"", "auto"),
    FULGUR_OPTION(floating, timeout,
                  "Seconds a collective or the rendezvous may wait for the other ranks before failing", 1800.0))
